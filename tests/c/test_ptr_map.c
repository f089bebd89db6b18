/* test_ptr_map.c - the pointer hash table: lookups, find-or-insert, backward-shift removal
 * against a reference, the quarter-full limit, and how its hash spreads device pointers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "ptr_map.h"

/* Longest distance from an entry's home slot to the slot it sits in. */
static size_t longest_probe(const ptr_map *m)
{
    size_t longest = 0;
    for (size_t i = 0; i <= m->mask; i++) {
        if (!m->slots[i].key)
            continue;
        size_t distance = (i - ptr_map_slot(m, m->slots[i].key)) & m->mask;
        if (distance > longest)
            longest = distance;
    }
    return longest;
}

static void test_put_get_remove(void **state)
{
    (void)state;
    ptr_map m = {0};
    assert_null(ptr_map_get(&m, 512));
    assert_null(ptr_map_remove(&m, 512));
    for (uintptr_t k = 1; k <= 1000; k++)
        assert_int_equal(ptr_map_put(&m, k * 512, (void *)(k + 7)), 0);
    assert_int_equal(m.count, 1000);
    assert_int_equal(ptr_map_put(&m, 512, (void *)99), 0); /* an existing key: replaced, not added */
    assert_int_equal(m.count, 1000);
    assert_ptr_equal(ptr_map_get(&m, 512), (void *)99);
    assert_ptr_equal(ptr_map_get(&m, 1000 * 512), (void *)1007);
    assert_null(ptr_map_get(&m, 1001 * 512));
    assert_null(ptr_map_get(&m, 0)); /* 0 marks empty slots: never a key */
    assert_ptr_equal(ptr_map_remove(&m, 2 * 512), (void *)9);
    assert_null(ptr_map_get(&m, 2 * 512));
    assert_int_equal(m.count, 999);
    ptr_map_free(&m);
    assert_int_equal(m.count, 0);
    assert_null(ptr_map_get(&m, 512));
}

static void test_stays_at_most_a_quarter_full(void **state)
{
    (void)state;
    ptr_map m = {0};
    for (uintptr_t k = 1; k <= 5000; k++) {
        assert_int_equal(ptr_map_put(&m, k << 9, (void *)k), 0);
        assert_true(m.count * 4 <= m.mask + 1);
    }
    assert_int_equal(ptr_map_reserve(&m, 100000), 0);
    assert_true((m.count + 100000) * 4 <= m.mask + 1);
    ptr_map_free(&m);
}

static void test_find_or_insert(void **state)
{
    (void)state;
    ptr_map m = {0};
    ptr_map_entry *e = ptr_map_find_or_insert(&m, 4096);
    assert_non_null(e);
    assert_int_equal(e->key, 4096);
    assert_null(e->value); /* new: no value yet */
    e->value = (void *)5;
    assert_int_equal(m.count, 1);
    e = ptr_map_find_or_insert(&m, 4096);
    assert_ptr_equal(e->value, (void *)5); /* found, not inserted again */
    assert_int_equal(m.count, 1);
    assert_ptr_equal(ptr_map_remove(&m, 4096), (void *)5);
    assert_int_equal(m.count, 0);
    ptr_map_free(&m);
}

/* Random puts and removes against a plain array: backward-shift deletion must never lose an
 * entry that sits after the hole in its probe run. */
static void test_matches_a_reference_under_churn(void **state)
{
    (void)state;
    enum { KEYS = 4096, ROUNDS = 200000 };
    static void *reference[KEYS];
    ptr_map m = {0};
    uint64_t x = 88172645463325252ull;
    for (int round = 0; round < ROUNDS; round++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t k = (size_t)(x % KEYS);
        uintptr_t key = ((uintptr_t)k + 1) << 9;
        if (reference[k]) {
            assert_ptr_equal(ptr_map_remove(&m, key), reference[k]);
            reference[k] = NULL;
        } else {
            reference[k] = (void *)(uintptr_t)(round + 1);
            assert_int_equal(ptr_map_put(&m, key, reference[k]), 0);
        }
    }
    size_t live = 0;
    for (size_t k = 0; k < KEYS; k++) {
        assert_ptr_equal(ptr_map_get(&m, ((uintptr_t)k + 1) << 9), reference[k]);
        live += reference[k] != NULL;
    }
    assert_int_equal(m.count, live);
    ptr_map_free(&m);
}

/* Pointers that differ only in high bits (the same offset in segments 1 TiB apart, or on other
 * devices) must not share a home slot: a hash that read only the low bits of the key would put
 * all of these in one probe run. */
static void test_high_bits_spread_keys(void **state)
{
    (void)state;
    ptr_map m = {0};
    for (uintptr_t i = 1; i <= 1000; i++)
        assert_int_equal(ptr_map_put(&m, (i << 40) | 0x200000, (void *)i), 0);
    assert_true(longest_probe(&m) < 16);
    for (uintptr_t i = 1; i <= 1000; i++)
        assert_ptr_equal(ptr_map_get(&m, (i << 40) | 0x200000), (void *)i);
    ptr_map_free(&m);
}

/* Neighbouring 512-byte-aligned blocks, the allocator's usual keys, spread too. */
static void test_neighbouring_blocks_spread(void **state)
{
    (void)state;
    ptr_map m = {0};
    for (uintptr_t i = 1; i <= 20000; i++)
        assert_int_equal(ptr_map_put(&m, ((uintptr_t)1 << 44) + i * 512, (void *)i), 0);
    assert_true(longest_probe(&m) < 32);
    ptr_map_free(&m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_get_remove),
        cmocka_unit_test(test_stays_at_most_a_quarter_full),
        cmocka_unit_test(test_find_or_insert),
        cmocka_unit_test(test_matches_a_reference_under_churn),
        cmocka_unit_test(test_high_bits_spread_keys),
        cmocka_unit_test(test_neighbouring_blocks_spread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
