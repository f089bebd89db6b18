/* seccomp_util.h - binds a test's forked child with a seccomp filter (tests that check which
 * system calls the library makes, or how it copes when some are refused). */
#ifndef NPUALLOC_SECCOMP_UTIL_H
#define NPUALLOC_SECCOMP_UTIL_H

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#if defined(__x86_64__)
#define TEST_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define TEST_AUDIT_ARCH AUDIT_ARCH_AARCH64
#endif

#ifdef TEST_AUDIT_ARCH
/* System calls nr_a and nr_b get the action `listed`; every other one, and any call made under
 * another architecture's numbering, gets `others` (SECCOMP_RET_ALLOW, _KILL_PROCESS,
 * _ERRNO | e, ...).  The filter binds the calling process for good: call it in a forked child.
 * Returns 0, or -1 when the kernel refuses the filter. */
static inline int bind_seccomp_filter(uint32_t nr_a, uint32_t nr_b, uint32_t listed, uint32_t others)
{
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TEST_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, others),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr_a, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr_b, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, others),
        BPF_STMT(BPF_RET | BPF_K, listed),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
        return -1;
    return 0;
}
#endif

#endif
