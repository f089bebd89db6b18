/* test_avl.c - the intrusive AVL tree against a reference (a sorted bitmap of keys). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "avl.h"

typedef struct item {
    avl_node node;
    int key;
    bool in_tree;
} item;

#define N 2000

static int order(const avl_node *a, const avl_node *b)
{
    int x = AVL_ENTRY(a, item, node)->key, y = AVL_ENTRY(b, item, node)->key;
    return (x > y) - (x < y);
}

static int key_order(const void *key, const avl_node *n)
{
    int x = *(const int *)key, y = AVL_ENTRY(n, item, node)->key;
    return (x > y) - (x < y);
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Keys are 2*i so floor/ceil of odd keys have a unique answer. */
static void test_random_operations_keep_invariants_and_answers(void **state)
{
    (void)state;
    static item items[N];
    avl_tree t;
    avl_init(&t);
    for (int i = 0; i < N; i++) {
        items[i].key = 2 * i;
        items[i].in_tree = false;
    }
    for (int step = 0; step < 40000; step++) {
        item *it = &items[rng() % N];
        if (it->in_tree)
            avl_remove(&t, &it->node);
        else
            avl_insert(&t, &it->node, order);
        it->in_tree = !it->in_tree;
        if (step % 997 == 0)
            assert_true(avl_check(&t, order));
        int probe = (int)(rng() % (2 * N + 2)) - 1;
        avl_node *f = avl_floor(&t, &probe, key_order), *c = avl_ceil(&t, &probe, key_order);
        int want_floor = -1, want_ceil = -1;
        for (int k = probe; k >= 0; k--)
            if (k % 2 == 0 && k / 2 < N && items[k / 2].in_tree) {
                want_floor = k;
                break;
            }
        for (int k = probe < 0 ? 0 : probe; k < 2 * N; k++)
            if (k % 2 == 0 && items[k / 2].in_tree) {
                want_ceil = k;
                break;
            }
        assert_int_equal(f ? AVL_ENTRY(f, item, node)->key : -1, want_floor);
        assert_int_equal(c ? AVL_ENTRY(c, item, node)->key : -1, want_ceil);
    }
    assert_true(avl_check(&t, order));
    size_t live = 0;
    for (int i = 0; i < N; i++)
        live += items[i].in_tree;
    assert_int_equal(t.count, live);
}

static void test_iteration_is_sorted_both_ways(void **state)
{
    (void)state;
    static item items[500];
    avl_tree t;
    avl_init(&t);
    for (int i = 0; i < 500; i++) {
        items[i].key = (i * 7919) % 500; /* a permutation */
        avl_insert(&t, &items[i].node, order);
    }
    int expect = 0;
    for (avl_node *n = avl_first(&t); n; n = avl_next(n))
        assert_int_equal(AVL_ENTRY(n, item, node)->key, expect++);
    assert_int_equal(expect, 500);
    for (avl_node *n = avl_last(&t); n; n = avl_prev(n))
        assert_int_equal(AVL_ENTRY(n, item, node)->key, --expect);
    int k = 250;
    assert_ptr_equal(AVL_ENTRY(avl_find(&t, &k, key_order), item, node)->key == 250 ? &k : NULL, &k);
    k = 1000;
    assert_null(avl_find(&t, &k, key_order));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_operations_keep_invariants_and_answers),
        cmocka_unit_test(test_iteration_is_sorted_both_ways),
    };
    return cmocka_run_group_tests_name("avl", tests, NULL, NULL);
}
