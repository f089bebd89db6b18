/*
 * mem.c - plain memory functions: aclrtMalloc family, pinned host memory, memset and memcpy
 * (synchronous and on streams), aclrtGetMemInfo.
 *
 * Device pointers are validated against the address registry (vmm.h) and touched only while
 * the registry's read lock is held, so an invalid or freed pointer is an error code, never a
 * fault.  Pinned host memory is looked up in this module's own set and touched while its lock
 * is held; any other host memory is copied by the kernel (host_move_checked), so a bad host
 * address is an error code too.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "avl.h"
#include "common.h"
#include "device.h"
#include "graph.h"
#include "host.h"
#include "mem.h"
#include "stream.h"
#include "vmm.h"

#define MALLOC_PAD 32               /* aclrtMalloc pads every allocation by 32 bytes */
#define MAX_ALLOC_SIZE ((size_t)1 << 60)

/* ---- aclrtMalloc family ---- */

/* Which HBM page kinds a page policy tries, in order (HUGE_FIRST falls back to normal pages). */
static void choose_hbm_kinds(uint32_t base, size_t size, vmm_kind_choice *choice)
{
    switch (base) {
    case ACL_MEM_MALLOC_HUGE_FIRST:
    case ACL_MEM_MALLOC_HUGE_FIRST_P2P:
        if (size <= MiB)
            *choice = (vmm_kind_choice){{MEM_NORMAL}, 1};
        else
            *choice = (vmm_kind_choice){{MEM_HUGE, MEM_NORMAL}, 2};
        return;
    case ACL_MEM_MALLOC_HUGE_ONLY:
    case ACL_MEM_MALLOC_HUGE_ONLY_P2P:
        *choice = (vmm_kind_choice){{MEM_HUGE}, 1};
        return;
    case ACL_MEM_MALLOC_NORMAL_ONLY:
    case ACL_MEM_MALLOC_NORMAL_ONLY_P2P:
        *choice = (vmm_kind_choice){{MEM_NORMAL}, 1};
        return;
    case ACL_MEM_MALLOC_HUGE1G_ONLY:
    case ACL_MEM_MALLOC_HUGE1G_ONLY_P2P:
        *choice = (vmm_kind_choice){{MEM_HUGE1G}, 1};
        return;
    default:
        /* CANN: an unknown policy uses huge pages from 2 MiB on, normal pages below. */
        if (size >= 2 * MiB)
            *choice = (vmm_kind_choice){{MEM_HUGE, MEM_NORMAL}, 2};
        else
            *choice = (vmm_kind_choice){{MEM_NORMAL}, 1};
        return;
    }
}

/* A policy split once, so that the pad and the page kinds follow from the same reading: its page
 * part (HUGE_FIRST .. HUGE1G_ONLY_P2P; any other value is CANN's unknown policy) and its pool.
 * The bandwidth flag picks the pool (LOW: DDR); the page part works on either pool (the flag
 * alone is HUGE_FIRST); READONLY changes neither (vmm_malloc maps such memory read-only). */
typedef struct malloc_policy {
    uint32_t pages;
    bool ddr;
} malloc_policy;

static aclError parse_policy(uint32_t policy, malloc_policy *out)
{
    const uint32_t flag_bits =
        ACL_MEM_TYPE_LOW_BAND_WIDTH | ACL_MEM_TYPE_HIGH_BAND_WIDTH | ACL_MEM_ACCESS_USER_SPACE_READONLY;
    bool low = policy & ACL_MEM_TYPE_LOW_BAND_WIDTH, high = policy & ACL_MEM_TYPE_HIGH_BAND_WIDTH;
    uint32_t pages = policy & ~flag_bits;
    if ((low && high) || (low && pages > ACL_MEM_MALLOC_HUGE1G_ONLY_P2P))
        return ACL_ERROR_INVALID_PARAM;
    *out = (malloc_policy){pages, low};
    return ACL_SUCCESS;
}

/* DDR has no 1 GiB pages: a 1 GiB policy takes normal DDR pages there. */
static bool takes_1g_pages(malloc_policy p)
{
    return !p.ddr && (p.pages == ACL_MEM_MALLOC_HUGE1G_ONLY || p.pages == ACL_MEM_MALLOC_HUGE1G_ONLY_P2P);
}

/* The page kinds a policy tries, in order. */
static void choose_kinds(malloc_policy p, size_t size, vmm_kind_choice *choice)
{
    choose_hbm_kinds(p.pages, size, choice);
    if (p.ddr)
        for (int i = 0; i < choice->count; i++)
            choice->kinds[i] = choice->kinds[i] == MEM_HUGE ? MEM_DDR_HUGE : MEM_DDR;
}

static aclError device_malloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy, bool pad)
{
    if (!devPtr || size == 0)
        return ACL_ERROR_INVALID_PARAM;
    /* CANN's ACL layer computes (size + 32 + pad - 1) / 32 * 32 before it asks the runtime and
     * refuses a size for which size + 32 + pad overflows, with no device needed; it leaves the pad
     * out for the two exact 1 GiB policy values only. */
    bool huge1g = policy == ACL_MEM_MALLOC_HUGE1G_ONLY || policy == ACL_MEM_MALLOC_HUGE1G_ONLY_P2P;
    size_t append = pad && !huge1g ? 32 + MALLOC_PAD : 32;
    if (size > SIZE_MAX - append)
        return ACL_ERROR_INVALID_PARAM;
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    if (size > MAX_ALLOC_SIZE)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    malloc_policy mp;
    if ((rc = parse_policy((uint32_t)policy, &mp)) != ACL_SUCCESS)
        return rc;
    /* Aligned up to 32 bytes, plus 32 bytes of padding (none for 1 GiB pages). */
    size_t bytes = round_up(size, 32);
    if (pad && !takes_1g_pages(mp))
        bytes += MALLOC_PAD;
    vmm_kind_choice choice;
    choose_kinds(mp, bytes, &choice);
    return vmm_malloc(dev, bytes, choice, VMM_OWNER_USER, policy & ACL_MEM_ACCESS_USER_SPACE_READONLY, devPtr);
}

aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return device_malloc(devPtr, size, policy, true);
}

aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return device_malloc(devPtr, size, policy, true);
}

aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return device_malloc(devPtr, size, policy, false);
}

aclError aclrtFree(void *devPtr)
{
    if (!devPtr)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    return vmm_free_malloc(devPtr, VMM_OWNER_USER) == ACL_SUCCESS ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_FREE;
}

/* ---- pinned host memory ---- */

typedef struct host_block {
    avl_node node;
    uintptr_t addr;
    size_t size;
} host_block;

/* Owned by this module: guards the set of live pinned host blocks (read-held while a copy
 * touches one). */
static pthread_rwlock_t host_lock = PTHREAD_RWLOCK_INITIALIZER;
static avl_tree host_blocks;

static int host_block_key_order(const void *key, const avl_node *n)
{
    uintptr_t x = *(const uintptr_t *)key, y = AVL_ENTRY(n, host_block, node)->addr;
    return (x > y) - (x < y);
}

static int host_block_order(const avl_node *a, const avl_node *b)
{
    return host_block_key_order(&AVL_ENTRY(a, host_block, node)->addr, b);
}

aclError aclrtMallocHost(void **hostPtr, size_t size)
{
    if (!hostPtr || size == 0)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    host_block *b = malloc(sizeof *b);
    void *p;
    if (!b || host_alloc_pinned(size, &p) != 0) { /* host_alloc_pinned charges the pinned count */
        free(b);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    b->addr = (uintptr_t)p;
    b->size = size;
    pthread_rwlock_wrlock(&host_lock);
    avl_insert(&host_blocks, &b->node, host_block_order);
    pthread_rwlock_unlock(&host_lock);
    *hostPtr = p;
    return ACL_SUCCESS;
}

aclError aclrtFreeHost(void *hostPtr)
{
    if (!hostPtr)
        return ACL_ERROR_INVALID_PARAM;
    uintptr_t key = (uintptr_t)hostPtr;
    pthread_rwlock_wrlock(&host_lock);
    avl_node *n = avl_find(&host_blocks, &key, host_block_key_order);
    if (n)
        avl_remove(&host_blocks, n);
    pthread_rwlock_unlock(&host_lock);
    if (!n)
        return ACL_ERROR_RT_MEMORY_FREE;
    host_block *b = AVL_ENTRY(n, host_block, node);
    host_free_pinned(hostPtr, b->size);
    free(b);
    return ACL_SUCCESS;
}

/* With host_lock held: does [p, p + n) lie inside one pinned block? */
static bool pinned_locked(const void *p, size_t n)
{
    uintptr_t key = (uintptr_t)p;
    avl_node *f = avl_floor(&host_blocks, &key, host_block_key_order);
    if (!f)
        return false;
    const host_block *b = AVL_ENTRY(f, host_block, node);
    return key - b->addr < b->size && n <= b->size - (key - b->addr);
}

/* Is [p, p + n) inside one pinned block (aclrtMallocHost memory)? */
static bool pinned(const void *p, size_t n)
{
    pthread_rwlock_rdlock(&host_lock);
    bool in = pinned_locked(p, n);
    pthread_rwlock_unlock(&host_lock);
    return in;
}

static aclError checked_error(int err)
{
    switch (err) {
    case 0:
        return ACL_SUCCESS;
    case EFAULT: /* not mapped readable / writable: a bad address */
        return ACL_ERROR_RT_PARAM_INVALID;
    case ENOMEM:
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    default:
        return ACL_ERROR_RT_INTERNAL_ERROR;
    }
}

aclError mem_move_locked(void *dst, range_class dc, const void *src, range_class sc, size_t count)
{
    /* Both sides through the runtime's view: an overlapping copy inside read-only memory must see the
     * same addresses on both sides for memmove to pick its direction. */
    if (dc == RANGE_DEVICE)
        dst = vmm_runtime_view_locked(dst);
    if (sc == RANGE_DEVICE)
        src = vmm_runtime_view_locked(src);
    if (likely(dc != RANGE_HOST && sc != RANGE_HOST)) { /* device memory on both sides */
        memmove(dst, src, count);
        return ACL_SUCCESS;
    }
    pthread_rwlock_rdlock(&host_lock);
    int err = 0;
    if ((dc != RANGE_HOST || pinned_locked(dst, count)) && (sc != RANGE_HOST || pinned_locked(src, count)))
        memmove(dst, src, count);
    else
        err = host_move_checked(dst, src, count);
    pthread_rwlock_unlock(&host_lock);
    return checked_error(err);
}

aclError mem_set_locked(void *dst, range_class dc, int value, size_t count)
{
    if (likely(dc != RANGE_HOST)) {
        memset(vmm_runtime_view_locked(dst), value, count);
        return ACL_SUCCESS;
    }
    pthread_rwlock_rdlock(&host_lock);
    int err = 0;
    if (pinned_locked(dst, count))
        memset(dst, value, count);
    else
        err = host_set_checked(dst, value, count);
    pthread_rwlock_unlock(&host_lock);
    return checked_error(err);
}

/* ---- memset / memcpy ---- */

/* With the registry read lock held: checks the ranges of a copy and whether its devices may
 * exchange data; `*dc`/`*sc` receive the ranges' classes. */
static aclError check_copy_locked(void *dst, const void *src, size_t count, range_class *dcp, range_class *scp)
{
    int32_t dd = -1, sd = -1;
    range_class dc = *dcp = vmm_classify_locked(dst, count, &dd);
    range_class sc = *scp = vmm_classify_locked(src, count, &sd);
    if (dc == RANGE_INVALID || sc == RANGE_INVALID)
        return ACL_ERROR_RT_PARAM_INVALID;
    if (unlikely(graph_ranges_active())) /* graph memory (graph.c): its access masks, checked lifetimes */
        return graph_check_locked(dst, dc, dd, src, sc, sd, count);
    if (dc == RANGE_DEVICE && sc == RANGE_DEVICE && dd >= 0 && sd >= 0 && !device_peer_enabled(dd, sd))
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    return ACL_SUCCESS;
}

static aclError check_memset_locked(void *dst, size_t count, range_class *cp)
{
    int32_t dev = -1;
    range_class c = *cp = vmm_classify_locked(dst, count, &dev);
    if (c == RANGE_INVALID)
        return ACL_ERROR_RT_PARAM_INVALID;
    if (unlikely(graph_ranges_active())) /* graph memory (graph.c): checked lifetimes */
        return graph_check_locked(dst, c, dev, NULL, RANGE_HOST, -1, count);
    return ACL_SUCCESS;
}

/* The kinds CANN's ACL layer translates for aclrtMemcpy and aclrtMemcpyAsync alike: HOST_TO_HOST ..
 * HOST_TO_BUF_TO_DEVICE (the INNER_ / INTER_DEVICE_TO_DEVICE kinds are not among them). */
static aclError copy_args_check(void *dst, size_t destMax, const void *src, size_t count, int kind)
{
    if (!dst || !src || kind < 0 || kind > ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE)
        return ACL_ERROR_INVALID_PARAM;
    if (count > destMax)
        return ACL_ERROR_RT_PARAM_INVALID;
    return ACL_SUCCESS;
}

/* The start of a synchronous copy or memset: the runtime started, then the capture modes' verdict on
 * it while some capture is active (CANN lists these calls as unsafe during a capture: graph.c). */
static aclError sync_call_start(void)
{
    aclError rc = runtime_ensure_init();
    if (rc == ACL_SUCCESS && unlikely(graph_capture_active()))
        rc = graph_unsafe_call_check();
    return rc;
}

/* Which sides of a copy lie outside device memory (the `span` bytes from each)? */
static void host_sides(void *dst, size_t dst_span, const void *src, size_t src_span, bool *dst_host, bool *src_host)
{
    int32_t dev;
    vmm_read_lock();
    *dst_host = vmm_classify_locked(dst, dst_span, &dev) == RANGE_HOST;
    *src_host = vmm_classify_locked(src, src_span, &dev) == RANGE_HOST;
    vmm_read_unlock();
}

/* Is this a copy between host and device memory (sides as host_sides gives them) whose host side, the
 * `span` bytes from it, is pageable (not aclrtMallocHost memory)?  CANN's runtime makes such an
 * "asynchronous" copy a synchronous one, since the device cannot reach pageable pages later: it waits for
 * the stream and copies, so the call returns with the copy done (aclrtMemcpyAsync's and
 * aclrtMemcpy2dAsync's documentation). */
static bool pageable_transfer(bool dst_host, bool src_host, void *dst, size_t dst_span, const void *src,
                              size_t src_span)
{
    return dst_host != src_host && !(dst_host ? pinned(dst, dst_span) : pinned(src, src_span));
}

/* The start of the synchronous copy an asynchronous one of pageable memory becomes, in the order of
 * CANN's runtime: the stream drained (a stream being captured refuses that: ACL_ERROR_RT_STREAM_CAPTURED),
 * then the capture modes' verdict, under the code CANN gives a refused converted copy; the memory is
 * checked as the copy is made. */
static aclError pageable_copy_start(aclrtStream stream)
{
    aclError rc = aclrtSynchronizeStream(stream);
    if (rc == ACL_SUCCESS && unlikely(graph_capture_active()) &&
        graph_unsafe_call_check() == ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT)
        rc = ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC;
    return rc;
}

/* The synchronous copy: checked and made under the registry's read lock. */
static aclError copy_now(void *dst, const void *src, size_t count)
{
    range_class dc, sc;
    vmm_read_lock();
    aclError rc = check_copy_locked(dst, src, count, &dc, &sc);
    if (rc == ACL_SUCCESS)
        rc = mem_move_locked(dst, dc, src, sc, count);
    vmm_read_unlock();
    return rc;
}

aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind)
{
    if (count == 0)
        return ACL_SUCCESS;
    aclError rc = copy_args_check(dst, destMax, src, count, (int)kind);
    if (rc != ACL_SUCCESS || dst == src) /* CANN's runtime: nothing to copy, after the argument checks */
        return rc;
    if ((rc = sync_call_start()) != ACL_SUCCESS)
        return rc;
    return copy_now(dst, src, count);
}

aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count)
{
    if (count == 0)
        return ACL_SUCCESS;
    if (!devPtr)
        return ACL_ERROR_INVALID_PARAM;
    if (count > maxCount)
        return ACL_ERROR_RT_PARAM_INVALID;
    aclError rc = sync_call_start();
    if (rc != ACL_SUCCESS)
        return rc;
    range_class c;
    vmm_read_lock();
    rc = check_memset_locked(devPtr, count, &c);
    if (rc == ACL_SUCCESS)
        rc = mem_set_locked(devPtr, c, value, count);
    vmm_read_unlock();
    return rc;
}

/* An asynchronous copy or memset: validated when queued and again when it runs, because
 * the memory may be freed in between; a bad host address shows only when it runs.  Either
 * way the stream gets a sticky error, not a fault. */
typedef struct mem_task {
    void *dst;
    const void *src; /* NULL for memset */
    size_t count;
    int value;
} mem_task;

static aclError run_mem_task(void *arg)
{
    mem_task *t = arg;
    range_class dc, sc;
    vmm_read_lock();
    aclError rc = t->src ? check_copy_locked(t->dst, t->src, t->count, &dc, &sc)
                         : check_memset_locked(t->dst, t->count, &dc);
    if (rc == ACL_SUCCESS)
        rc = t->src ? mem_move_locked(t->dst, dc, t->src, sc, t->count) : mem_set_locked(t->dst, dc, t->value, t->count);
    vmm_read_unlock();
    return rc == ACL_SUCCESS ? ACL_SUCCESS : ACL_ERROR_RT_DEVICE_MEM_ERROR;
}

/* Queues fn on the stream with its own copy of the `size` bytes of `task`, as a plain task: every caller
 * found the stream not capturing first (graph_capture_active, graph_capture_memop), and a capture begun
 * since would take it as a generic node, neither the MEMCPY / MEMSET node nor the operation queued now. */
static aclError enqueue_task(aclrtStream stream, stream_task_fn fn, const void *task, size_t size)
{
    npu_stream *s;
    aclError rc = stream_acquire(stream, &s);
    if (rc != ACL_SUCCESS)
        return rc;
    void *t = malloc(size);
    if (!t) {
        stream_release(s);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    memcpy(t, task, size);
    rc = stream_enqueue_plain(s, fn, t, free, NULL);
    stream_release(s);
    if (rc != ACL_SUCCESS)
        free(t);
    return rc;
}

static aclError enqueue_mem_task(aclrtStream stream, mem_task task)
{
    return enqueue_task(stream, run_mem_task, &task, sizeof task);
}

aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream)
{
    if (count == 0)
        return ACL_SUCCESS;
    aclError rc = copy_args_check(dst, destMax, src, count, (int)kind);
    if (rc != ACL_SUCCESS)
        return rc;
    if ((rc = runtime_ensure_init()) != ACL_SUCCESS)
        return rc;
    bool dst_host, src_host;
    host_sides(dst, count, src, count, &dst_host, &src_host);
    if ((dst_host && src_host) || dst == src) {
        /* CANN's runtime, after checking the stream, with the host attached to the device (aclrtGetRunMode's
         * ACL_HOST): no copy between two host buffers on a stream, pinned or not; then nothing to copy when
         * the two are one. */
        npu_stream *s;
        if ((rc = stream_acquire(stream, &s)) != ACL_SUCCESS)
            return rc;
        stream_release(s);
        return dst_host && src_host ? ACL_ERROR_RT_FEATURE_NOT_SUPPORT : ACL_SUCCESS;
    }
    if (pageable_transfer(dst_host, src_host, dst, count, src, count)) { /* made now, after the stream's queued work */
        rc = pageable_copy_start(stream);
        return rc == ACL_SUCCESS ? copy_now(dst, src, count) : rc;
    }
    /* graph capture (graph.c): on a capturing stream the copy becomes a MEMCPY node */
    if (unlikely(graph_capture_active()) && graph_capture_memop(stream, dst, src, count, 0, true, &rc))
        return rc;
    range_class dc, sc;
    vmm_read_lock();
    rc = check_copy_locked(dst, src, count, &dc, &sc);
    vmm_read_unlock();
    if (rc != ACL_SUCCESS)
        return rc;
    return enqueue_mem_task(stream, (mem_task){.dst = dst, .src = src, .count = count});
}

aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream)
{
    if (count == 0)
        return ACL_SUCCESS;
    if (!devPtr)
        return ACL_ERROR_INVALID_PARAM;
    if (count > maxCount)
        return ACL_ERROR_RT_PARAM_INVALID;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    /* graph capture (graph.c): on a capturing stream the memset becomes a MEMSET node */
    if (unlikely(graph_capture_active()) && graph_capture_memop(stream, devPtr, NULL, count, value, false, &rc))
        return rc;
    range_class c;
    vmm_read_lock();
    rc = check_memset_locked(devPtr, count, &c);
    vmm_read_unlock();
    if (rc != ACL_SUCCESS)
        return rc;
    return enqueue_mem_task(stream, (mem_task){.dst = devPtr, .count = count, .value = value});
}

/* ---- 2-D copies ---- */

/* CANN's runtime refuses more rows, or longer ones, than these. */
#define MEMCPY2D_MAX_HEIGHT ((size_t)5 << 20)
#define MEMCPY2D_MAX_WIDTH ((size_t)5000000)

/* `height` rows of `width` bytes, `spitch` bytes apart at src and `dpitch` bytes apart at dst. */
typedef struct copy2d {
    void *dst;
    const void *src;
    size_t dpitch, spitch, width, height;
    int kind;
} copy2d;

static void *row_at(const void *base, size_t pitch, size_t i) { return (void *)((uintptr_t)base + i * pitch); }

/* Do `height` rows of `width` bytes, `pitch` apart from p, stay below the top of the address space? */
static bool rows_fit(const void *p, size_t pitch, size_t width, size_t height)
{
    uintptr_t room = UINTPTR_MAX - (uintptr_t)p;
    return width <= room && height - 1 <= (room - width) / pitch;
}

/* The checks of CANN's ACL layer (pointers, height, width, width against both pitches, kind), in its
 * order, then its runtime's (the limits; DEVICE_TO_DEVICE, which the ACL layer lets through, is not
 * supported there), then the span of the rows. */
static aclError copy2d_args_check(const copy2d *c)
{
    int kind = c->kind;
    if (!c->dst || !c->src || c->height == 0 || c->width == 0 || c->width > c->spitch || c->width > c->dpitch)
        return ACL_ERROR_INVALID_PARAM;
    if (kind != ACL_MEMCPY_HOST_TO_DEVICE && kind != ACL_MEMCPY_DEVICE_TO_HOST && kind != ACL_MEMCPY_DEVICE_TO_DEVICE &&
        kind != ACL_MEMCPY_DEFAULT)
        return ACL_ERROR_INVALID_PARAM;
    if (c->height > MEMCPY2D_MAX_HEIGHT || c->width > MEMCPY2D_MAX_WIDTH)
        return ACL_ERROR_RT_PARAM_INVALID;
    if (kind == ACL_MEMCPY_DEVICE_TO_DEVICE)
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (!rows_fit(c->dst, c->dpitch, c->width, c->height) || !rows_fit(c->src, c->spitch, c->width, c->height))
        return ACL_ERROR_RT_PARAM_INVALID;
    return ACL_SUCCESS;
}

/* Does a row's direction (host to device if `to_device`) contradict the kind?  CANN's runtime takes
 * the direction from the pointers, overriding the kind, for aclrtMallocHost memory; for other host
 * memory it accepts only the kind of the pointers' direction, or DEFAULT. */
static bool contradicts_kind(int kind, bool to_device, const void *host_side, size_t width)
{
    if (kind != (to_device ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_DEVICE))
        return false;
    return !pinned(host_side, width);
}

/* With the registry read lock held: checks every row as aclrtMemcpy checks its range, with one side
 * host memory and the other device memory (CANN's runtime copies only host to device or device to host)
 * in a direction the kind allows, then, if `move`, copies the rows.  Nothing is copied unless every row
 * passes. */
static aclError copy2d_locked(const copy2d *c, bool move)
{
    for (int pass = 0; pass < (move ? 2 : 1); pass++) {
        for (size_t i = 0; i < c->height; i++) {
            void *d = row_at(c->dst, c->dpitch, i);
            const void *s = row_at(c->src, c->spitch, i);
            range_class dc, sc;
            aclError rc = check_copy_locked(d, s, c->width, &dc, &sc);
            if (rc == ACL_SUCCESS && ((dc == RANGE_HOST) == (sc == RANGE_HOST) ||
                                      contradicts_kind(c->kind, sc == RANGE_HOST, sc == RANGE_HOST ? s : d, c->width)))
                rc = ACL_ERROR_RT_PARAM_INVALID;
            if (rc == ACL_SUCCESS && pass == 1)
                rc = mem_move_locked(d, dc, s, sc, c->width);
            if (rc != ACL_SUCCESS)
                return rc;
        }
    }
    return ACL_SUCCESS;
}

/* copy2d_locked under the registry's read lock. */
static aclError copy2d_checked(const copy2d *c, bool move)
{
    vmm_read_lock();
    aclError rc = copy2d_locked(c, move);
    vmm_read_unlock();
    return rc;
}

aclError aclrtMemcpy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                       aclrtMemcpyKind kind)
{
    copy2d c = {dst, src, dpitch, spitch, width, height, (int)kind};
    aclError rc = copy2d_args_check(&c);
    if (rc != ACL_SUCCESS || (rc = sync_call_start()) != ACL_SUCCESS)
        return rc;
    return copy2d_checked(&c, true);
}

/* The queued 2-D copy, checked again when it runs (the memory may be gone by then). */
static aclError run_copy2d_task(void *arg)
{
    aclError rc = copy2d_checked(arg, true);
    return rc == ACL_SUCCESS ? ACL_SUCCESS : ACL_ERROR_RT_DEVICE_MEM_ERROR;
}

aclError aclrtMemcpy2dAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                            aclrtMemcpyKind kind, aclrtStream stream)
{
    copy2d c = {dst, src, dpitch, spitch, width, height, (int)kind};
    aclError rc = copy2d_args_check(&c);
    if (rc != ACL_SUCCESS)
        return rc;
    if ((rc = runtime_ensure_init()) != ACL_SUCCESS)
        return rc;
    size_t dst_span = (height - 1) * dpitch + width, src_span = (height - 1) * spitch + width;
    bool dst_host, src_host;
    host_sides(dst, dst_span, src, src_span, &dst_host, &src_host);
    if (pageable_transfer(dst_host, src_host, dst, dst_span, src, src_span)) {
        if ((rc = pageable_copy_start(stream)) != ACL_SUCCESS) /* as aclrtMemcpyAsync's */
            return rc;
        return copy2d_checked(&c, true);
    }
    if (unlikely(graph_capture_active())) {
        /* graph capture (graph.c): on a capturing stream each row becomes a MEMCPY node, in order, checked
         * as aclrtMemcpyAsync's are; the first row refused ends the call, the rows before it stay captured
         * (CANN's runtime, too, queues a 2-D copy as several tasks and stops at the first it cannot). */
        size_t i = 0;
        while (i < height && graph_capture_memop(stream, row_at(dst, dpitch, i), row_at(src, spitch, i), width, 0,
                                                 true, &rc)) {
            if (rc != ACL_SUCCESS)
                return rc;
            i++;
        }
        if (i == height)
            return ACL_SUCCESS;
        /* The capture ended after row i - 1 (in another thread): the rest is an ordinary copy. */
        c.dst = row_at(dst, dpitch, i);
        c.src = row_at(src, spitch, i);
        c.height -= i;
    }
    rc = copy2d_checked(&c, false);
    if (rc != ACL_SUCCESS)
        return rc;
    return enqueue_task(stream, run_copy2d_task, &c, sizeof c);
}

aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free_bytes, size_t *total_bytes)
{
    if (!free_bytes || !total_bytes)
        return ACL_ERROR_INVALID_PARAM;
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    device_mem_info(dev, attr, free_bytes, total_bytes);
    return ACL_SUCCESS;
}

/* ---- lifetime ---- */

void mem_atfork_prepare(void) { pthread_rwlock_wrlock(&host_lock); }
void mem_atfork_parent(void) { pthread_rwlock_unlock(&host_lock); }
void mem_atfork_child(void) { rwlock_reset_in_child(&host_lock); }

void mem_shutdown(void)
{
    pthread_rwlock_wrlock(&host_lock);
    while (host_blocks.root) {
        host_block *b = AVL_ENTRY(host_blocks.root, host_block, node);
        avl_remove(&host_blocks, &b->node);
        host_free_pinned((void *)b->addr, b->size);
        free(b);
    }
    pthread_rwlock_unlock(&host_lock);
}
