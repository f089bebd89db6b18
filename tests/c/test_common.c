/* test_common.c - the helpers of common.h: rounding, overflow checks, growable arrays. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "common.h"

static void test_round_up_and_add_overflows(void **state)
{
    (void)state;
    assert_int_equal(round_up(0, 512), 0);
    assert_int_equal(round_up(1, 512), 512);
    assert_int_equal(round_up(512, 512), 512);
    assert_int_equal(round_up(513, 512), 1024);
    assert_false(add_overflows(SIZE_MAX - 1, 1));
    assert_true(add_overflows(SIZE_MAX, 1));
}

static void test_array_reserve_grows_by_doubling_and_keeps_items(void **state)
{
    (void)state;
    uint64_t *items = NULL;
    size_t cap = 0;
    assert_true(ARRAY_RESERVE(items, cap, 0, 8)); /* nothing needed: nothing allocated */
    assert_null(items);
    assert_int_equal(cap, 0);
    assert_true(ARRAY_RESERVE(items, cap, 1, 8));
    assert_int_equal(cap, 8);
    for (uint64_t i = 0; i < 8; i++)
        items[i] = i * 3;
    assert_true(ARRAY_RESERVE(items, cap, 9, 8));
    assert_int_equal(cap, 16);
    assert_true(ARRAY_RESERVE(items, cap, 100, 8));
    assert_int_equal(cap, 128);
    for (uint64_t i = 0; i < 8; i++)
        assert_int_equal(items[i], i * 3);
    uint64_t *before = items;
    assert_true(ARRAY_RESERVE(items, cap, 128, 8)); /* enough room: unchanged */
    assert_ptr_equal(items, before);
    free(items);
}

static void test_array_reserve_refuses_sizes_that_overflow(void **state)
{
    (void)state;
    uint64_t *items = NULL;
    size_t cap = 0;
    assert_true(ARRAY_RESERVE(items, cap, 4, 4));
    items[3] = 42;
    uint64_t *before = items;
    assert_false(ARRAY_RESERVE(items, cap, SIZE_MAX / 4, 4)); /* bytes would overflow size_t */
    assert_false(ARRAY_RESERVE(items, cap, SIZE_MAX, 4));     /* the doubling would overflow */
    assert_ptr_equal(items, before);                           /* unchanged */
    assert_int_equal(cap, 4);
    assert_int_equal(items[3], 42);
    free(items);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_up_and_add_overflows),
        cmocka_unit_test(test_array_reserve_grows_by_doubling_and_keeps_items),
        cmocka_unit_test(test_array_reserve_refuses_sizes_that_overflow),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
