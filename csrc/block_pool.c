/* block_pool.c - see block_pool.h. */
#include "block_pool.h"

#include <stdlib.h>
#include <string.h>

#include "caching.h"
#include "common.h"

/* Size classes over u = (size - 1) / 512: exact for u < 64 (up to 32 KiB), then 16 per power of
 * two.  Classes grow with size, so scanning classes upward visits sizes upward.
 *
 * Why size - 1: each class then ends at a power-of-two multiple (2 MiB, 20 MiB, ...) instead of
 * starting there.  A whole cached segment is such a size, and splitting a request off it (and
 * merging the request back on free) now mostly leaves it in its class: its index entry is re-keyed
 * in place instead of moving between bins twice per cache hit.  Sizes are never 0 here (blocks
 * and rounded requests are at least 512 bytes). */
#define EXACT_CLASSES 64
#define SUB_BITS 4
#define BIN_COUNT (EXACT_CLASSES + (64 - 6) * (1 << SUB_BITS))
#define BIN_WORDS ((BIN_COUNT + 63) / 64)

/* A bin holds its blocks in (size, address) order, as a sorted list while it has few of them and
 * as a tree beyond that.  Why: most bins hold a handful of blocks, and linking one into a short
 * list costs a fraction of a tree insertion and its rebalancing; the tree keeps a bin with
 * thousands of blocks of one size logarithmic.  A list becomes a tree when an insertion would
 * make it longer than LIST_MAX; a tree becomes a list when a removal leaves LIST_MIN blocks (the
 * gap keeps a bin near the threshold from converting back and forth).
 *
 * List mode: `first` is the smallest block's node; in each node, `right` is the next block's
 * node and `left` the previous one's (`parent` unused).  Tree mode: `tree` (`first` unused). */
#define LIST_MAX 32
#define LIST_MIN 12

typedef struct size_bin {
    avl_node *first;
    avl_tree tree;
    uint32_t count;
    bool is_tree;
} size_bin;

struct stream_bins {
    uint64_t stream;
    uint64_t summary;           /* bit w: words[w] != 0 */
    uint64_t words[BIN_WORDS];  /* bit c: bins[c] is not empty */
    size_bin bins[BIN_COUNT];
    size_t count;
};

static inline unsigned size_class(size_t size)
{
    size_t u = (size - 1) >> 9;
    /* Both answers are computed and one selected (a cmov): a branch here was mispredicted on
     * about a third of the synthetic benchmark's pairs.  u | EXACT_CLASSES keeps fl >= 6. */
    unsigned fl = 63u - (unsigned)__builtin_clzll((unsigned long long)(u | EXACT_CLASSES));
    unsigned sl = (unsigned)(u >> (fl - SUB_BITS)) & ((1u << SUB_BITS) - 1);
    unsigned coarse = EXACT_CLASSES + (fl - 6) * (1u << SUB_BITS) + sl;
    return u < EXACT_CLASSES ? (unsigned)u : coarse;
}

static inline cache_block *entry(avl_node *n) { return n ? AVL_ENTRY(n, cache_block, pool_node) : NULL; }

/* (size, address) order inside a bin. */
static inline bool before(const cache_block *a, const cache_block *b)
{
    return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
}

static void mark(stream_bins *sb, unsigned c)
{
    sb->words[c >> 6] |= (uint64_t)1 << (c & 63);
    sb->summary |= (uint64_t)1 << (c >> 6);
}

static void unmark(stream_bins *sb, unsigned c)
{
    sb->words[c >> 6] &= ~((uint64_t)1 << (c & 63));
    if (!sb->words[c >> 6])
        sb->summary &= ~((uint64_t)1 << (c >> 6));
}

/* The first non-empty class at or after c, or BIN_COUNT. */
static unsigned next_class(const stream_bins *sb, unsigned c)
{
    if (c >= BIN_COUNT)
        return BIN_COUNT;
    unsigned w = c >> 6;
    uint64_t bits = sb->words[w] & (~(uint64_t)0 << (c & 63));
    if (bits)
        return (w << 6) + (unsigned)__builtin_ctzll(bits);
    uint64_t words = w + 1 < 64 ? sb->summary & (~(uint64_t)0 << (w + 1)) : 0;
    if (!words)
        return BIN_COUNT;
    w = (unsigned)__builtin_ctzll(words);
    return (w << 6) + (unsigned)__builtin_ctzll(sb->words[w]);
}

/* The last non-empty class at or before c, or -1. */
static int prev_class(const stream_bins *sb, int c)
{
    if (c < 0)
        return -1;
    unsigned w = (unsigned)c >> 6;
    unsigned bit = (unsigned)c & 63;
    uint64_t bits = sb->words[w] & (bit == 63 ? ~(uint64_t)0 : (((uint64_t)1 << (bit + 1)) - 1));
    if (bits)
        return (int)((w << 6) + 63 - (unsigned)__builtin_clzll(bits));
    uint64_t words = w ? sb->summary & (((uint64_t)1 << w) - 1) : 0;
    if (!words)
        return -1;
    w = 63 - (unsigned)__builtin_clzll(words);
    return (int)((w << 6) + 63 - (unsigned)__builtin_clzll(sb->words[w]));
}

/* ---- streams ---- */

/* Index of the first stream at or after `stream` in the pool's sorted array. */
static size_t stream_index(const block_pool *p, uint64_t stream)
{
    size_t lo = 0, hi = p->stream_count;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (p->streams[mid]->stream < stream)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static stream_bins *bins_of(const block_pool *p, uint64_t stream)
{
    /* Nearly always one or two streams: check the first before searching. */
    if (p->stream_count && p->streams[0]->stream == stream)
        return p->streams[0];
    size_t i = stream_index(p, stream);
    return i < p->stream_count && p->streams[i]->stream == stream ? p->streams[i] : NULL;
}

int block_pool_prepare(block_pool *p, uint64_t stream)
{
    if (likely(bins_of(p, stream) != NULL))
        return 0;
    if (!ARRAY_RESERVE(p->streams, p->stream_capacity, p->stream_count + 1, 2))
        return -1;
    stream_bins *sb = calloc(1, sizeof *sb); /* zeroed trees and bitmaps are empty ones */
    if (!sb)
        return -1;
    sb->stream = stream;
    size_t i = stream_index(p, stream);
    memmove(&p->streams[i + 1], &p->streams[i], (p->stream_count - i) * sizeof *p->streams);
    p->streams[i] = sb;
    p->stream_count++;
    return 0;
}

void block_pool_init(block_pool *p, bool is_small, private_pool *owner)
{
    memset(p, 0, sizeof *p);
    avl_init(&p->unmapped);
    p->is_small = is_small;
    p->owner = owner;
}

void block_pool_destroy(block_pool *p)
{
    for (size_t i = 0; i < p->stream_count; i++)
        free(p->streams[i]);
    free(p->streams);
    p->streams = NULL;
    p->stream_count = p->stream_capacity = 0;
    p->count = 0;
}

/* ---- one bin ---- */

static void bin_to_tree(size_bin *bin)
{
    /* In order, each node is the largest so far: it goes right of the previous one. */
    avl_node *n = bin->first, *last = NULL;
    avl_init(&bin->tree);
    while (n) {
        avl_node *next = n->right;
        avl_link(&bin->tree, n, last, last ? &last->right : &bin->tree.root);
        last = n;
        n = next;
    }
    bin->first = NULL;
    bin->is_tree = true;
}

static void bin_to_list(size_bin *bin)
{
    avl_node *nodes[LIST_MIN];
    uint32_t k = 0;
    for (avl_node *n = avl_first(&bin->tree); n; n = avl_next(n))
        nodes[k++] = n; /* the count is LIST_MIN here */
    for (uint32_t i = 0; i < k; i++) {
        nodes[i]->left = i ? nodes[i - 1] : NULL;
        nodes[i]->right = i + 1 < k ? nodes[i + 1] : NULL;
        nodes[i]->parent = NULL;
    }
    bin->first = k ? nodes[0] : NULL;
    avl_init(&bin->tree);
    bin->is_tree = false;
}

/* The tree halves of the bin operations stay out of line: inlined, their register needs would
 * make every list operation (nearly all of them) save and restore registers too. */
static __attribute__((noinline)) void bin_tree_insert(size_bin *bin, cache_block *b)
{
    avl_node *parent = NULL, **link = &bin->tree.root;
    while (*link) {
        parent = *link;
        link = before(b, entry(parent)) ? &parent->left : &parent->right;
    }
    avl_link(&bin->tree, &b->pool_node, parent, link);
}

static __attribute__((noinline)) void bin_tree_remove(size_bin *bin, cache_block *b)
{
    avl_remove(&bin->tree, &b->pool_node);
    if (bin->count == LIST_MIN)
        bin_to_list(bin);
}

static inline void bin_insert(size_bin *bin, cache_block *b)
{
    if (unlikely(!bin->is_tree && bin->count == LIST_MAX))
        bin_to_tree(bin);
    bin->count++;
    if (bin->is_tree) {
        bin_tree_insert(bin, b);
        return;
    }
    avl_node *node = &b->pool_node, *prev = NULL, *next = bin->first;
    while (next && before(entry(next), b)) {
        prev = next;
        next = next->right;
    }
    node->left = prev;
    node->right = next;
    node->parent = NULL;
    if (prev)
        prev->right = node;
    else
        bin->first = node;
    if (next)
        next->left = node;
}

static inline void bin_remove(size_bin *bin, cache_block *b)
{
    avl_node *node = &b->pool_node;
    bin->count--;
    if (bin->is_tree) {
        bin_tree_remove(bin, b);
        return;
    }
    if (node->left)
        node->left->right = node->right;
    else
        bin->first = node->right;
    if (node->right)
        node->right->left = node->left;
}

/* n takes old's place in the bin. */
static void bin_replace(size_bin *bin, avl_node *old, avl_node *n)
{
    if (bin->is_tree) {
        avl_replace(&bin->tree, old, n);
        return;
    }
    *n = *old;
    if (n->left)
        n->left->right = n;
    else
        bin->first = n;
    if (n->right)
        n->right->left = n;
}

static inline const size_bin *bin_of(const cache_block *b) { return &b->pool_bins->bins[b->pool_bin]; }

/* b's neighbours inside its bin. */
static cache_block *bin_next(const cache_block *b)
{
    return entry(bin_of(b)->is_tree ? avl_next(&b->pool_node) : b->pool_node.right);
}

static cache_block *bin_prev(const cache_block *b)
{
    return entry(bin_of(b)->is_tree ? avl_prev(&b->pool_node) : b->pool_node.left);
}

/* The smallest (size, address) of a bin, and the largest. */
static cache_block *bin_first(const stream_bins *sb, unsigned c)
{
    const size_bin *bin = &sb->bins[c];
    return entry(bin->is_tree ? avl_first(&bin->tree) : bin->first);
}

static cache_block *bin_last(const stream_bins *sb, unsigned c)
{
    const size_bin *bin = &sb->bins[c];
    if (bin->is_tree)
        return entry(avl_last(&bin->tree));
    avl_node *n = bin->first;
    while (n && n->right)
        n = n->right;
    return entry(n);
}

/* The first block of a bin at least `size` big, or NULL. */
static cache_block *bin_lower_bound(const size_bin *bin, size_t size)
{
    if (!bin->is_tree) {
        avl_node *n = bin->first;
        while (n && entry(n)->size < size)
            n = n->right;
        return entry(n);
    }
    avl_node *n = bin->tree.root, *best = NULL;
    while (n) {
        if (entry(n)->size >= size) {
            best = n;
            n = n->left;
        } else {
            n = n->right;
        }
    }
    return entry(best);
}

/* ---- the free-block index ---- */

static inline void insert_into(block_pool *p, stream_bins *sb, cache_block *b)
{
    unsigned c = size_class(b->size);
    bin_insert(&sb->bins[c], b);
    b->pool_bin = c;
    b->pool_bins = sb;
    if (sb->bins[c].count == 1) /* the bin was empty: nearly always it was not */
        mark(sb, c);
    sb->count++;
    p->count++;
    b->in_pool = true;
}

/* The four operations of a cache hit (insert, remove, rekey, lower_bound) are ALWAYS_INLINE:
 * external functions still, but a link-time-optimised build (the extension, the benchmarks)
 * inlines them into the allocator instead of calling them. */
ALWAYS_INLINE void block_pool_insert(block_pool *p, cache_block *b)
{
    /* A block keeps pool_bins after leaving the index, and never changes pool or stream: a block
     * that was indexed before needs no lookup.  A new one's bins were prepared by the allocation
     * that made it. */
    insert_into(p, b->pool_bins ? b->pool_bins : bins_of(p, b->stream), b);
}

ALWAYS_INLINE void block_pool_remove(block_pool *p, cache_block *b)
{
    stream_bins *sb = b->pool_bins;
    unsigned c = b->pool_bin;
    bin_remove(&sb->bins[c], b);
    if (!sb->bins[c].count)
        unmark(sb, c);
    sb->count--;
    p->count--;
    b->in_pool = false;
}

ALWAYS_INLINE void block_pool_rekey(block_pool *p, cache_block *b, uintptr_t ptr, size_t size)
{
    if (size_class(size) == b->pool_bin) {
        const cache_block *lo = bin_prev(b), *hi = bin_next(b);
        if ((!lo || (lo->size != size ? lo->size < size : lo->ptr < ptr)) &&
            (!hi || (size != hi->size ? size < hi->size : ptr < hi->ptr))) {
            b->ptr = ptr;
            b->size = size;
            return;
        }
    }
    block_pool_remove(p, b);
    b->ptr = ptr;
    b->size = size;
    insert_into(p, b->pool_bins, b); /* same stream: no lookup */
}

void block_pool_transplant(cache_block *old, cache_block *b)
{
    bin_replace(&old->pool_bins->bins[old->pool_bin], &old->pool_node, &b->pool_node);
    b->pool_bin = old->pool_bin;
    b->pool_bins = old->pool_bins;
    b->in_pool = true;
    old->in_pool = false;
}

/* The first block of the stream's bins at or after class c. */
static cache_block *first_from(const stream_bins *sb, unsigned c)
{
    c = next_class(sb, c);
    return c < BIN_COUNT ? bin_first(sb, c) : NULL;
}

/* The first block of the streams from index i on. */
static cache_block *first_of_streams(const block_pool *p, size_t i)
{
    for (; i < p->stream_count; i++)
        if (p->streams[i]->count)
            return first_from(p->streams[i], 0);
    return NULL;
}

ALWAYS_INLINE cache_block *block_pool_lower_bound(const block_pool *p, uint64_t stream, size_t size)
{
    /* Nearly always one or two streams: check the first before searching. */
    size_t i = p->stream_count && p->streams[0]->stream == stream ? 0 : stream_index(p, stream);
    if (i < p->stream_count && p->streams[i]->stream == stream) {
        const stream_bins *sb = p->streams[i];
        unsigned c = size_class(size);
        /* In the request's own class sizes vary (above 32 KiB): the first one big enough. */
        cache_block *best = bin_lower_bound(&sb->bins[c], size);
        if (best)
            return best;
        cache_block *b = first_from(sb, c + 1);
        if (b)
            return b;
        i++;
    }
    return first_of_streams(p, i);
}

cache_block *block_pool_next(const cache_block *b)
{
    const block_pool *p = b->pool;
    cache_block *in_bin = bin_next(b);
    if (in_bin)
        return in_bin;
    size_t i = stream_index(p, b->stream);
    cache_block *next = first_from(p->streams[i], b->pool_bin + 1);
    return next ? next : first_of_streams(p, i + 1);
}

cache_block *block_pool_prev(const cache_block *b)
{
    const block_pool *p = b->pool;
    cache_block *in_bin = bin_prev(b);
    if (in_bin)
        return in_bin;
    size_t i = stream_index(p, b->stream);
    int c = prev_class(p->streams[i], (int)b->pool_bin - 1);
    if (c >= 0)
        return bin_last(p->streams[i], (unsigned)c);
    while (i-- > 0) {
        c = prev_class(p->streams[i], BIN_COUNT - 1);
        if (c >= 0)
            return bin_last(p->streams[i], (unsigned)c);
    }
    return NULL;
}

cache_block *block_pool_first(const block_pool *p) { return first_of_streams(p, 0); }

cache_block *block_pool_last_of_stream(const block_pool *p, uint64_t stream)
{
    const stream_bins *sb = bins_of(p, stream);
    if (!sb)
        return NULL;
    int c = prev_class(sb, BIN_COUNT - 1);
    return c >= 0 ? bin_last(sb, (unsigned)c) : NULL;
}

size_t block_pool_count(const block_pool *p) { return p->count; }

/* ---- the checker ---- */

static int tree_order(const avl_node *a, const avl_node *b)
{
    return before(entry((avl_node *)a), entry((avl_node *)b)) ? -1 : before(entry((avl_node *)b), entry((avl_node *)a));
}

/* Is block b, found in class c of sb, where its fields say? */
static bool block_is_at(const cache_block *b, const stream_bins *sb, unsigned c)
{
    return b->in_pool && b->pool_bins == sb && b->pool_bin == c && b->stream == sb->stream && size_class(b->size) == c;
}

static bool bin_check(const stream_bins *sb, unsigned c)
{
    const size_bin *bin = &sb->bins[c];
    bool marked = (sb->words[c >> 6] >> (c & 63)) & 1;
    if (marked != (bin->count != 0))
        return false;
    if (bin->is_tree) {
        if (bin->count <= LIST_MIN || bin->tree.count != bin->count || !avl_check(&bin->tree, tree_order))
            return false;
        for (const avl_node *n = avl_first(&bin->tree); n; n = avl_next(n))
            if (!block_is_at(entry((avl_node *)n), sb, c))
                return false;
        return true;
    }
    uint32_t count = 0;
    const avl_node *prev = NULL;
    for (const avl_node *n = bin->first; n; prev = n, n = n->right) {
        if (++count > LIST_MAX || n->left != prev || (prev && !before(entry((avl_node *)prev), entry((avl_node *)n))) ||
            !block_is_at(entry((avl_node *)n), sb, c))
            return false;
    }
    return count == bin->count;
}

bool block_pool_check(const block_pool *p)
{
    size_t total = 0;
    for (size_t i = 0; i < p->stream_count; i++) {
        const stream_bins *sb = p->streams[i];
        if (i && p->streams[i - 1]->stream >= sb->stream)
            return false;
        size_t count = 0;
        for (unsigned w = 0; w < BIN_WORDS; w++)
            if (((sb->summary >> w) & 1) != (sb->words[w] != 0))
                return false;
        /* Most of the classes are empty: those are checked with one test (the heap checkers of the
         * tests and fuzzers run this after every operation). */
        for (unsigned c = 0; c < BIN_COUNT; c++) {
            const size_bin *bin = &sb->bins[c];
            bool marked = (sb->words[c >> 6] >> (c & 63)) & 1;
            if (!marked && !(bin->count | (uintptr_t)bin->first | (uintptr_t)bin->is_tree))
                continue;
            if (!bin_check(sb, c))
                return false;
            count += bin->count;
        }
        if (count != sb->count)
            return false;
        total += count;
    }
    return total == p->count;
}

/* ---- the unmapped set ---- */

static int unmapped_order(const avl_node *a, const avl_node *b)
{
    const cache_block *x = entry((avl_node *)a), *y = entry((avl_node *)b);
    if (x->stream != y->stream)
        return x->stream < y->stream ? -1 : 1;
    return (x->ptr > y->ptr) - (x->ptr < y->ptr);
}

/* Orders "the start of a stream" against an unmapped block: never equal. */
static int stream_start_order(const void *key, const avl_node *n)
{
    uint64_t stream = *(const uint64_t *)key;
    return stream <= entry((avl_node *)n)->stream ? -1 : 1;
}

void block_pool_insert_unmapped(block_pool *p, cache_block *b) { avl_insert(&p->unmapped, &b->pool_node, unmapped_order); }

void block_pool_remove_unmapped(block_pool *p, cache_block *b) { avl_remove(&p->unmapped, &b->pool_node); }

cache_block *block_pool_first_unmapped(const block_pool *p, uint64_t stream)
{
    cache_block *b = entry(avl_ceil(&p->unmapped, &stream, stream_start_order));
    return b && b->stream == stream ? b : NULL;
}

cache_block *block_pool_next_unmapped(const cache_block *b) { return entry(avl_next(&b->pool_node)); }
