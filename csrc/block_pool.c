/* block_pool.c - see block_pool.h. */
#include "block_pool.h"

#include "caching.h"

static int block_order(const avl_node *a, const avl_node *b)
{
    const cache_block *x = AVL_ENTRY(a, cache_block, pool_node), *y = AVL_ENTRY(b, cache_block, pool_node);
    if (x->stream != y->stream)
        return x->stream < y->stream ? -1 : 1;
    if (x->size != y->size)
        return x->size < y->size ? -1 : 1;
    return (x->ptr > y->ptr) - (x->ptr < y->ptr);
}

typedef struct pool_key {
    uint64_t stream;
    size_t size;
} pool_key;

/* Orders the key (stream, size, address 0) against a block: never equal. */
static int key_order(const void *key, const avl_node *n)
{
    const pool_key *k = key;
    const cache_block *b = AVL_ENTRY(n, cache_block, pool_node);
    if (k->stream != b->stream)
        return k->stream < b->stream ? -1 : 1;
    return k->size <= b->size ? -1 : 1;
}

/* Orders "just past every block of a stream" against a block. */
static int stream_end_order(const void *key, const avl_node *n)
{
    uint64_t stream = *(const uint64_t *)key;
    return stream < AVL_ENTRY(n, cache_block, pool_node)->stream ? -1 : 1;
}

void block_pool_init(block_pool *p, bool is_small, private_pool *owner)
{
    avl_init(&p->blocks);
    avl_init(&p->unmapped);
    p->is_small = is_small;
    p->search_count = 0;
    p->owner = owner;
}

void block_pool_insert(block_pool *p, cache_block *b)
{
    avl_insert(&p->blocks, &b->pool_node, block_order);
    b->in_pool = true;
}

void block_pool_remove(block_pool *p, cache_block *b)
{
    avl_remove(&p->blocks, &b->pool_node);
    b->in_pool = false;
}

cache_block *block_pool_lower_bound(const block_pool *p, uint64_t stream, size_t size)
{
    pool_key k = {stream, size};
    avl_node *n = avl_ceil(&p->blocks, &k, key_order);
    return n ? AVL_ENTRY(n, cache_block, pool_node) : NULL;
}

cache_block *block_pool_next(const cache_block *b)
{
    avl_node *n = avl_next(&b->pool_node);
    return n ? AVL_ENTRY(n, cache_block, pool_node) : NULL;
}

cache_block *block_pool_prev(const cache_block *b)
{
    avl_node *n = avl_prev(&b->pool_node);
    return n ? AVL_ENTRY(n, cache_block, pool_node) : NULL;
}

cache_block *block_pool_first(const block_pool *p)
{
    avl_node *n = avl_first(&p->blocks);
    return n ? AVL_ENTRY(n, cache_block, pool_node) : NULL;
}

cache_block *block_pool_last_of_stream(const block_pool *p, uint64_t stream)
{
    avl_node *n = avl_floor(&p->blocks, &stream, stream_end_order);
    if (!n)
        return NULL;
    cache_block *b = AVL_ENTRY(n, cache_block, pool_node);
    return b->stream == stream ? b : NULL;
}

size_t block_pool_count(const block_pool *p) { return p->blocks.count; }

static int unmapped_order(const avl_node *a, const avl_node *b)
{
    const cache_block *x = AVL_ENTRY(a, cache_block, pool_node), *y = AVL_ENTRY(b, cache_block, pool_node);
    if (x->stream != y->stream)
        return x->stream < y->stream ? -1 : 1;
    return (x->ptr > y->ptr) - (x->ptr < y->ptr);
}

/* Orders "the start of a stream" against an unmapped block: never equal. */
static int stream_start_order(const void *key, const avl_node *n)
{
    uint64_t stream = *(const uint64_t *)key;
    return stream <= AVL_ENTRY(n, cache_block, pool_node)->stream ? -1 : 1;
}

void block_pool_insert_unmapped(block_pool *p, cache_block *b) { avl_insert(&p->unmapped, &b->pool_node, unmapped_order); }

void block_pool_remove_unmapped(block_pool *p, cache_block *b) { avl_remove(&p->unmapped, &b->pool_node); }

cache_block *block_pool_first_unmapped(const block_pool *p, uint64_t stream)
{
    avl_node *n = avl_ceil(&p->unmapped, &stream, stream_start_order);
    if (!n)
        return NULL;
    cache_block *b = AVL_ENTRY(n, cache_block, pool_node);
    return b->stream == stream ? b : NULL;
}

cache_block *block_pool_next_unmapped(const cache_block *b)
{
    avl_node *n = avl_next(&b->pool_node);
    return n ? AVL_ENTRY(n, cache_block, pool_node) : NULL;
}
