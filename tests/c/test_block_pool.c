/* test_block_pool.c - the free-block index against a model: a sorted array of the same blocks.
 *
 * Random insertions, removals, re-keys and transplants on a few streams, with sizes crowded into
 * a few bins so that bins keep growing past the list-to-tree threshold and shrinking below the
 * tree-to-list one.  After every step the pool's order (first/next, and prev backwards),
 * lower_bound for every stream and a range of sizes, and last_of_stream must agree with the model,
 * and the pool's own checker must pass. */
#include "testutil.h"

#include "block_pool.h"
#include "caching.h"

#define BLOCKS 400
#define STREAMS 3

typedef struct model {
    block_pool pool;
    cache_block blocks[BLOCKS];
    uint64_t rng;
} model;

static uint64_t next_random(model *m)
{
    m->rng ^= m->rng << 13;
    m->rng ^= m->rng >> 7;
    m->rng ^= m->rng << 17;
    return m->rng;
}

/* (stream, size, address): torch's order. */
static int order(const cache_block *a, const cache_block *b)
{
    if (a->stream != b->stream)
        return a->stream < b->stream ? -1 : 1;
    if (a->size != b->size)
        return a->size < b->size ? -1 : 1;
    return (a->ptr > b->ptr) - (a->ptr < b->ptr);
}

static int order_ptrs(const void *a, const void *b)
{
    return order(*(cache_block *const *)a, *(cache_block *const *)b);
}

/* Sizes in a few crowded bins: one exact class (4 KiB), two classes above 32 KiB with varied sizes
 * inside them, and a spread of other sizes. */
static size_t random_size(model *m)
{
    switch (next_random(m) % 4) {
    case 0:
        return 4096;
    case 1:
        return 1048576 + 512 * (next_random(m) % 64);
    case 2:
        return 40960 + 512 * (next_random(m) % 8);
    default:
        return 512 * (1 + next_random(m) % 300);
    }
}

/* Unique addresses: block i owns [i * 1 GiB, (i + 1) * 1 GiB). */
static uintptr_t random_ptr(model *m, size_t i) { return (uintptr_t)(i + 1) * GiB_ + 512 * (next_random(m) % 1024); }

static void check_against_model(model *m)
{
    cache_block *sorted[BLOCKS];
    size_t n = 0;
    for (size_t i = 0; i < BLOCKS; i++)
        if (m->blocks[i].in_pool)
            sorted[n++] = &m->blocks[i];
    qsort(sorted, n, sizeof *sorted, order_ptrs);
    assert_int_equal(block_pool_count(&m->pool), n);
    assert_true(block_pool_check(&m->pool));

    cache_block *b = block_pool_first(&m->pool);
    for (size_t k = 0; k < n; k++, b = block_pool_next(b))
        assert_ptr_equal(b, sorted[k]);
    assert_null(b);
    for (size_t k = n; k-- > 1;)
        assert_ptr_equal(block_pool_prev(sorted[k]), sorted[k - 1]);
    if (n)
        assert_null(block_pool_prev(sorted[0]));

    for (uint64_t stream = 0; stream <= STREAMS; stream++) {
        cache_block *last = NULL;
        for (size_t k = 0; k < n; k++)
            if (sorted[k]->stream == stream)
                last = sorted[k];
        assert_ptr_equal(block_pool_last_of_stream(&m->pool, stream), last);
        for (int probe = 0; probe < 8; probe++) {
            size_t size = random_size(m);
            cache_block key = {.stream = stream, .size = size, .ptr = 0};
            cache_block *want = NULL;
            for (size_t k = 0; k < n && !want; k++)
                if (order(sorted[k], &key) >= 0)
                    want = sorted[k];
            assert_ptr_equal(block_pool_lower_bound(&m->pool, stream, size), want);
        }
    }
}

static void test_index_matches_a_sorted_model(void **state)
{
    (void)state;
    static model m;
    memset(&m, 0, sizeof m);
    m.rng = 0x9e3779b97f4a7c15ull;
    block_pool_init(&m.pool, false, NULL);
    for (uint64_t s = 0; s < STREAMS; s++)
        assert_int_equal(block_pool_prepare(&m.pool, s), 0);
    for (size_t i = 0; i < BLOCKS; i++)
        m.blocks[i].pool = &m.pool;

    const int steps = random_steps(20000, 5000, 1500);
    for (int step = 0; step < steps; step++) {
        size_t i = next_random(&m) % BLOCKS;
        cache_block *b = &m.blocks[i];
        /* Phases: mostly insert for a while, then mostly remove, so bins cross both thresholds. */
        bool filling = (step / 2000) % 2 == 0;
        unsigned action = next_random(&m) % 10;
        if (!b->in_pool) {
            if (action < (filling ? 8u : 3u)) {
                uint64_t stream = next_random(&m) % STREAMS;
                if (stream != b->stream)
                    b->pool_bins = NULL; /* a block never changes stream: this is a new one */
                b->stream = stream;
                b->size = random_size(&m);
                b->ptr = random_ptr(&m, i);
                block_pool_insert(&m.pool, b);
                assert_true(b->in_pool);
            } else {
                /* A transplant: b (not indexed) takes an indexed block's place, then its key. */
                cache_block *old = &m.blocks[next_random(&m) % BLOCKS];
                if (old->in_pool) {
                    b->stream = old->stream;
                    b->size = 0; /* stale until the re-key */
                    block_pool_transplant(old, b);
                    assert_false(old->in_pool);
                    assert_true(b->in_pool);
                    block_pool_rekey(&m.pool, b, random_ptr(&m, i), random_size(&m));
                }
            }
        } else if (action < (filling ? 3u : 7u)) {
            block_pool_remove(&m.pool, b);
            assert_false(b->in_pool);
        } else {
            /* A re-key: a split shrinks a block, a merge grows it; sometimes it stays in its bin. */
            size_t size = action % 2 ? b->size + 512 * (next_random(&m) % 4) : random_size(&m);
            block_pool_rekey(&m.pool, b, random_ptr(&m, i), size);
        }
        check_against_model(&m);
    }
    block_pool_destroy(&m.pool);
}

/* Many blocks of one size (one bin, a tree) then all removed but a few (a list again): the order
 * holds across both conversions, from either end. */
static void test_one_bin_grows_and_shrinks(void **state)
{
    (void)state;
    static model m;
    memset(&m, 0, sizeof m);
    m.rng = 12345;
    block_pool_init(&m.pool, true, NULL);
    assert_int_equal(block_pool_prepare(&m.pool, 7), 0);
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < BLOCKS; i++) {
            cache_block *b = &m.blocks[i];
            b->pool = &m.pool;
            b->stream = 7;
            b->size = 2048;
            b->ptr = random_ptr(&m, round % 2 ? BLOCKS - 1 - i : i); /* ascending, then descending */
            block_pool_insert(&m.pool, b);
            if (i % 37 == 0)
                check_against_model(&m);
        }
        check_against_model(&m);
        for (size_t i = 0; i < BLOCKS - 3; i++) {
            block_pool_remove(&m.pool, &m.blocks[(i * 7) % BLOCKS]);
            if (i % 29 == 0 || i > BLOCKS - 30)
                check_against_model(&m);
        }
        for (size_t i = 0; i < BLOCKS; i++)
            if (m.blocks[i].in_pool)
                block_pool_remove(&m.pool, &m.blocks[i]);
        check_against_model(&m);
    }
    block_pool_destroy(&m.pool);
}

/* The checker is not vacuous: it sees a block out of order, in a list bin and in a tree bin. */
static void test_checker_sees_a_block_out_of_order(void **state)
{
    (void)state;
    static model m;
    memset(&m, 0, sizeof m);
    block_pool_init(&m.pool, false, NULL);
    assert_int_equal(block_pool_prepare(&m.pool, 0), 0);
    for (size_t count = 5; count <= 40; count += 35) { /* a list bin, then a tree bin */
        for (size_t i = 0; i < count; i++) {
            cache_block *b = &m.blocks[i];
            b->pool = &m.pool;
            b->size = 8192;
            b->ptr = (uintptr_t)(i + 1) * GiB_;
            block_pool_insert(&m.pool, b);
        }
        assert_true(block_pool_check(&m.pool));
        uintptr_t saved = m.blocks[1].ptr;
        m.blocks[1].ptr = m.blocks[3].ptr + 512; /* now after its successor */
        assert_false(block_pool_check(&m.pool));
        m.blocks[1].ptr = saved;
        assert_true(block_pool_check(&m.pool));
        m.blocks[2].pool_bin++; /* records the wrong bin */
        assert_false(block_pool_check(&m.pool));
        m.blocks[2].pool_bin--;
        for (size_t i = 0; i < count; i++)
            block_pool_remove(&m.pool, &m.blocks[i]);
        assert_true(block_pool_check(&m.pool));
    }
    block_pool_destroy(&m.pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_index_matches_a_sorted_model),
        cmocka_unit_test(test_one_bin_grows_and_shrinks),
        cmocka_unit_test(test_checker_sees_a_block_out_of_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
