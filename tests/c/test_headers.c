/* test_headers.c - a program written as CANN programs are, including "acl/acl.h" and
 * "acl/acl_rt.h" (and nothing of npualloc's own), compiles and links against libnpualloc.a. */
#include "acl/acl.h"
#include "acl/acl_rt.h" /* both, in either order: the include guards hold */

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

static void test_a_cann_style_program_runs(void **state)
{
    (void)state;
    assert_int_equal(aclInit(NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    void *d;
    char in[64] = "acl/acl.h", out[64] = {0};
    assert_int_equal(aclrtMalloc(&d, sizeof in, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(d, sizeof in, in, sizeof in, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(out, sizeof out, d, sizeof in, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_string_equal(out, "acl/acl.h");
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtResetDevice(0), ACL_SUCCESS);
    assert_int_equal(aclFinalize(), ACL_SUCCESS);
    /* a second aclFinalize: the header names CANN's code for it */
    assert_int_equal(ACL_ERROR_REPEAT_FINALIZE, 100037);
    assert_int_equal(aclFinalize(), ACL_ERROR_REPEAT_FINALIZE);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_a_cann_style_program_runs)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
