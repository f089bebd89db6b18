/*
 * counting_allocator.c - a pluggable allocator for npualloc.NPUPluggableAllocator (torch_npu's
 * signatures): device memory from aclrtMalloc, and a record of every call for the tests to read.
 *
 *   cc -shared -fPIC -I csrc/include tests/plugins/counting_allocator.c -o counting_allocator.so
 *
 * The aclrt* calls resolve against npualloc's extension when Python loads the library.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "acl_rt.h"

/* What the tests read through ctypes. */
long alloc_calls, free_calls;
size_t last_alloc_size, last_free_size;
int last_alloc_device, last_free_device;
uintptr_t last_alloc_stream, last_free_stream;
void *last_free_ptr;

void *counting_malloc(size_t size, int device, aclrtStream stream)
{
    alloc_calls++;
    last_alloc_size = size;
    last_alloc_device = device;
    last_alloc_stream = (uintptr_t)stream;
    /* aclrtMalloc allocates on the calling thread's device: make it `device` for the call. */
    int32_t previous = -1;
    int had_device = aclrtGetDevice(&previous) == ACL_SUCCESS;
    void *p = NULL;
    if (aclrtSetDevice(device) != ACL_SUCCESS || aclrtMalloc(&p, size ? size : 1, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS)
        p = NULL;
    if (had_device)
        aclrtSetDevice(previous);
    return p;
}

void counting_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    free_calls++;
    last_free_ptr = ptr;
    last_free_size = size;
    last_free_device = device;
    last_free_stream = (uintptr_t)stream;
    aclrtFree(ptr);
}

/* Refuses everything: an allocator out of memory. */
void *refusing_malloc(size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    alloc_calls++;
    return NULL;
}

/* Host memory, not the device's: what a pool must refuse. */
void *host_malloc(size_t size, int device, aclrtStream stream)
{
    (void)device;
    (void)stream;
    alloc_calls++;
    return malloc(size);
}

void host_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    free_calls++;
    last_free_ptr = ptr;
    free(ptr);
}
