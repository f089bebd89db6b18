/*
 * graph.c - captured graphs with planned memory (see npualloc_graph.h for the model and
 * graph.h for the hooks and the lock order).
 *
 * Dependencies.  Every node belongs to one capture stream and gets that stream's next sequence
 * number; it depends on the stream's frontier (the nodes the next node must follow), so a
 * stream's nodes form a chain.  Each node carries a vector clock: entry t is the highest sequence
 * number of stream t among its ancestors (itself included).  Node a is an ancestor of node b iff
 * clock(b)[stream(a)] >= seq(a).  Frontiers carry the clock of their nodes (the component-wise
 * maximum), and so do the event records made during the capture.
 *
 * Planning (at capture, so the pointer handed out is the one the launch uses).  Allocation X
 * conflicts with a new allocation Y unless X's FREE node is an ancestor of Y's ALLOC node.  Y goes
 * into the smallest gap between the conflicting allocations that fits it (lowest address among
 * equals), else after the last of them.  `active` holds the allocations, by offset, that may still
 * conflict with a future allocation: X leaves it once its FREE node is an ancestor of every
 * stream's frontier and of every event record of the capture (any future node descends from one
 * of those).
 */
#include "graph.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "caching.h"
#include "common.h"
#include "device.h"
#include "host.h"
#include "mem.h"
#include "npualloc.h"
#include "npualloc_graph.h"
#include "va_space.h"

_Atomic unsigned graph_capturing_streams;
_Atomic unsigned graph_live_ranges;

#define ALLOC_ALIGN ((size_t)512)
#define CHUNK_FIRST ((size_t)2 << 20)
#define CHUNK_MAX ((size_t)64 << 20)
#define LB_ALL_SEEDS_LIMIT 512 /* allocations up to which every allocation seeds a clique */

/* G_ENDING: capture_end has finalised the plan and is trimming the address range (outside graph_lock: a vmm
 * call); the graph becomes G_CAPTURED (instantiable) only once the range is trimmed, since an executable
 * graph's launch maps pages into the range and a range with mappings cannot shrink. */
enum { G_EMPTY, G_CAPTURING, G_ENDING, G_CAPTURED, G_BROKEN };

/* ------------------------------------------------------------------------------------------
 * Structures
 * ------------------------------------------------------------------------------------------ */

typedef struct gnode {
    uint8_t kind;  /* npualloc_graph_node_kind */
    uint32_t stream, seq;
    uint32_t dep_off, ndeps;
    uint32_t vc_off, vc_len;
    uint32_t alloc; /* ALLOC / FREE */
    void *dst;      /* MEMCPY / MEMSET */
    const void *src;
    size_t count;
    int32_t value;
    stream_task_fn fn; /* TASK / DELAY / HOST: the captured stream task */
    void *arg;
    stream_task_cleanup_fn cleanup;
} gnode;

typedef struct frontier {
    uint32_t *nodes;
    uint32_t n;
    size_t cap;
    uint32_t *vc;
    uint32_t vc_len;
} frontier;

typedef struct cap_stream {
    npu_stream *s; /* pinned while capturing, NULL afterwards */
    uint64_t handle;
    int32_t device;
    uint32_t seq; /* nodes recorded on it */
    frontier f;
    bool routed;  /* pool capture: a pool route is active for it */
} cap_stream;

typedef struct cap_event {
    uint64_t handle;
    frontier f;
} cap_event;

typedef struct galloc {
    uint64_t offset, size, requested;
    uint32_t node, free_node, stream;
    uint64_t access;
    uint32_t *uses; /* checked graphs: the nodes that used it */
    uint32_t nuses;
    size_t capuses;
    uint32_t *rec; /* record_stream: capture stream indices its FREE also waits for */
    uint32_t nrec;
    size_t caprec;
} galloc;

typedef struct acc_seg {
    uint64_t start, end, mask;
} acc_seg;

typedef struct range64 {
    uint64_t start, end;
} range64;

struct npualloc_graph {
    unsigned refs; /* the user's and the executable graph's (graph_lock) */
    uint64_t gen;
    bool checked;
    int state;
    int32_t device;
    uintptr_t base; /* address range (planned mode) */
    size_t reserved;
    bool pool_mode, pool_ref; /* pool_ref: the graph holds a reference to its pool (from capture_end) */
    npualloc_mempool_id pool;
    bool has_access;
    uint64_t access;
    gnode *nodes;
    size_t nnodes, capnodes;
    uint32_t *deps;
    size_t ndeps, capdeps;
    uint32_t *vcs;
    size_t nvcs, capvcs;
    galloc *allocs;
    size_t nallocs, capallocs;
    uint32_t *active; /* indices of allocs, by offset */
    size_t nactive, capactive;
    uint64_t footprint;
    cap_stream *streams;
    size_t nstreams, capstreams;
    cap_event *events;
    size_t nevents, capevents;
    struct npualloc_graph *cap_next; /* list of capturing graphs */
    unsigned joining;                /* streams that joined and are still taking their pool route (graph_lock) */
    aclmdlRICaptureMode mode;        /* capture mode (set at capture_begin) */
    uint64_t cap_thread;             /* the thread that began the capture (host_thread_serial) */
    /* violations (viol_lock) */
    char **viol;
    size_t nviol, capviol;
    bool capture_violation;
    /* finalised at capture end (immutable afterwards) */
    uint64_t lower_bound, output_bytes, mapped;
    acc_seg *acc;
    size_t nacc;
    range64 *outputs;
    size_t nout;
    bool registered;
    npualloc_graph_exec *exec;
};

typedef struct arena arena;

struct npualloc_graph_exec {
    npualloc_graph *g;
    uint64_t gen;
    uint32_t *run; /* nodes to queue at launch */
    size_t nrun;
    /* binding and launches (bind_lock) */
    struct launch_rec {
        npu_stream *s; /* pinned */
        uint64_t pos;  /* the stream's last task of the graph's last launch there */
    } *launches;
    size_t nlaunches, caplaunches;
    npu_stream *bound; /* pinned */
    arena *ar;
    uint64_t last_pos;
    size_t nchunks;            /* chunks mapped */
    aclrtDrvMemHandle *priv;   /* per chunk: a private handle, or NULL (the arena's) */
    bool *is_priv;             /* per chunk: an output lies in it */
};

struct arena {
    arena *next;
    npu_stream *s; /* pinned */
    uint64_t gen;
    int32_t device;
    aclrtDrvMemHandle *h;
    size_t n, cap;
    unsigned users;
};

typedef struct reg_entry {
    uintptr_t base;
    size_t size;
    npualloc_graph *g;
} reg_entry;

/* ------------------------------------------------------------------------------------------
 * Module state
 * ------------------------------------------------------------------------------------------ */

/* A stream joins a pool capture under graph_lock and takes its pool route after it (the caching
 * allocator's lock is never taken under graph_lock): the graph counts it in `joining` meanwhile, and
 * capture_end waits (join_cv) until none is left before it ends the routes, so no route lands once its
 * capture ended (it would stay for ever, on the pool's next recording).  No lock is held over the join's
 * pool call: a pool allocator running under the caching allocator's lock may wait for an event. */
static pthread_cond_t join_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t graph_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t bind_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_rwlock_t reg_lock = PTHREAD_RWLOCK_INITIALIZER;
static pthread_mutex_t viol_lock = PTHREAD_MUTEX_INITIALIZER;
static npualloc_graph *capturing; /* graph_lock */
static arena *arenas;             /* bind_lock */
static reg_entry *reg;            /* reg_lock, by base */
static size_t nreg, capreg;
/* npualloc_graph_set_mem_access, per device; forgotten when the runtime restarts. */
static pthread_mutex_t access_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mem_access[NPU_MAX_DEVICES];
static uint64_t mem_access_gen;

static uint64_t access_setting(int32_t device)
{
    pthread_mutex_lock(&access_lock);
    uint64_t m = mem_access_gen == npualloc_runtime_generation() ? mem_access[device] : 0;
    pthread_mutex_unlock(&access_lock);
    return m | ((uint64_t)1 << device);
}

static _Thread_local char last_err[512];


static void set_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_err(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_err, sizeof last_err, fmt, ap);
    va_end(ap);
}

const char *npualloc_graph_last_error(void) { return last_err; }

#define GROW(arr, cap, need) ARRAY_RESERVE(arr, cap, need, 8)

static bool graph_stale(const npualloc_graph *g) { return g->gen != npualloc_runtime_generation(); }

/* Chunk i of a graph's range: sizes 2, 2, 4, 8, 16, 32, 64, 64, ... MiB. */
static size_t chunk_size(size_t i)
{
    if (i == 0)
        return CHUNK_FIRST;
    size_t s = i - 1 < 8 ? CHUNK_FIRST << (i - 1) : CHUNK_MAX;
    return s < CHUNK_MAX ? s : CHUNK_MAX;
}

/* The number of chunks covering [0, bytes) and the bytes they span. */
static size_t chunks_covering(uint64_t bytes, uint64_t *span)
{
    size_t n = 0;
    uint64_t end = 0;
    while (end < bytes)
        end += chunk_size(n++);
    if (span)
        *span = end;
    return n;
}

/* ------------------------------------------------------------------------------------------
 * Vector clocks and frontiers (graph_lock held)
 * ------------------------------------------------------------------------------------------ */

static inline uint32_t vc_at(const uint32_t *vc, uint32_t len, uint32_t i) { return i < len ? vc[i] : 0; }

static inline const uint32_t *node_vc(const npualloc_graph *g, const gnode *n) { return g->vcs + n->vc_off; }

/* Is node a an ancestor of (or equal to) node b? */
static bool reaches(const npualloc_graph *g, uint32_t a, uint32_t b)
{
    if (a == b)
        return true;
    const gnode *na = &g->nodes[a], *nb = &g->nodes[b];
    return vc_at(node_vc(g, nb), nb->vc_len, na->stream) >= na->seq;
}

/* Is node a an ancestor of every node whose clock dominates vc? */
static bool dominated(const npualloc_graph *g, const uint32_t *vc, uint32_t len, uint32_t a)
{
    const gnode *na = &g->nodes[a];
    return vc_at(vc, len, na->stream) >= na->seq;
}

static bool vc_max_into(uint32_t **dst, uint32_t *dlen, const uint32_t *src, uint32_t slen)
{
    if (slen > *dlen) {
        uint32_t *p = realloc(*dst, slen * sizeof *p);
        if (!p)
            return false;
        memset(p + *dlen, 0, (slen - *dlen) * sizeof *p);
        *dst = p;
        *dlen = slen;
    }
    for (uint32_t i = 0; i < slen; i++)
        if (src[i] > (*dst)[i])
            (*dst)[i] = src[i];
    return true;
}

static void frontier_free(frontier *f)
{
    free(f->nodes);
    free(f->vc);
    memset(f, 0, sizeof *f);
}

/* Drops frontier nodes that are ancestors of another frontier node. */
static void frontier_prune(const npualloc_graph *g, frontier *f)
{
    uint32_t k = 0;
    for (uint32_t i = 0; i < f->n; i++) {
        bool redundant = false;
        for (uint32_t j = 0; j < f->n && !redundant; j++)
            if (j != i && f->nodes[j] != f->nodes[i] && reaches(g, f->nodes[i], f->nodes[j]))
                redundant = true;
        /* duplicates: keep the first */
        for (uint32_t j = 0; j < k && !redundant; j++)
            if (f->nodes[j] == f->nodes[i])
                redundant = true;
        if (!redundant)
            f->nodes[k++] = f->nodes[i];
    }
    f->n = k;
}

static bool frontier_merge(const npualloc_graph *g, frontier *dst, const frontier *src)
{
    if (!GROW(dst->nodes, dst->cap, (size_t)dst->n + src->n) || !vc_max_into(&dst->vc, &dst->vc_len, src->vc, src->vc_len))
        return false;
    if (src->n)
        memcpy(dst->nodes + dst->n, src->nodes, src->n * sizeof *src->nodes);
    dst->n += src->n;
    frontier_prune(g, dst);
    return true;
}

static bool frontier_copy(frontier *dst, const frontier *src)
{
    frontier f = {0};
    if (src->n && !GROW(f.nodes, f.cap, src->n))
        return false;
    if (src->vc_len && !(f.vc = malloc(src->vc_len * sizeof *f.vc))) {
        free(f.nodes);
        return false;
    }
    if (src->n)
        memcpy(f.nodes, src->nodes, src->n * sizeof *f.nodes);
    f.n = src->n;
    if (src->vc_len)
        memcpy(f.vc, src->vc, src->vc_len * sizeof *f.vc);
    f.vc_len = src->vc_len;
    frontier_free(dst);
    *dst = f;
    return true;
}

static int stream_index(const npualloc_graph *g, const npu_stream *s)
{
    for (size_t i = 0; i < g->nstreams; i++)
        if (g->streams[i].s == s)
            return (int)i;
    return -1;
}

/* Appends a node on capture stream si after its frontier (and the frontiers of the capture
 * streams in `extra`); the node becomes the stream's frontier.  graph_lock held. */
static aclError add_node(npualloc_graph *g, uint32_t si, const uint32_t *extra, uint32_t nextra, const gnode *proto,
                         uint32_t *out)
{
    cap_stream *cs = &g->streams[si];
    frontier f = {0};
    if (!frontier_copy(&f, &cs->f))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    for (uint32_t i = 0; i < nextra; i++) {
        if (extra[i] != si && !frontier_merge(g, &f, &g->streams[extra[i]].f)) {
            frontier_free(&f);
            return ACL_ERROR_RT_MEMORY_ALLOCATION;
        }
    }
    uint32_t vlen = (uint32_t)g->nstreams;
    if (!GROW(g->nodes, g->capnodes, g->nnodes + 1) || !GROW(g->deps, g->capdeps, g->ndeps + f.n) ||
        !GROW(g->vcs, g->capvcs, g->nvcs + vlen)) {
        frontier_free(&f);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    uint32_t idx = (uint32_t)g->nnodes;
    gnode *n = &g->nodes[g->nnodes++];
    *n = *proto;
    n->stream = si;
    n->seq = cs->seq + 1;
    n->dep_off = (uint32_t)g->ndeps;
    n->ndeps = f.n;
    if (f.n)
        memcpy(g->deps + g->ndeps, f.nodes, f.n * sizeof *f.nodes);
    g->ndeps += f.n;
    n->vc_off = (uint32_t)g->nvcs;
    n->vc_len = vlen;
    uint32_t *vc = g->vcs + g->nvcs;
    for (uint32_t i = 0; i < vlen; i++)
        vc[i] = vc_at(f.vc, f.vc_len, i);
    vc[si] = n->seq;
    g->nvcs += vlen;
    cs->seq++;
    /* The stream's frontier is now the node alone. */
    frontier_free(&f);
    frontier nf = {0};
    if (GROW(nf.nodes, nf.cap, 1) && (nf.vc = malloc(vlen * sizeof *nf.vc))) {
        nf.nodes[0] = idx;
        nf.n = 1;
        memcpy(nf.vc, vc, vlen * sizeof *vc);
        nf.vc_len = vlen;
        frontier_free(&cs->f);
        cs->f = nf;
    } else {
        /* Out of memory: keep the old frontier plus the node (still correct). */
        free(nf.nodes);
        if (GROW(cs->f.nodes, cs->f.cap, (size_t)cs->f.n + 1))
            cs->f.nodes[cs->f.n++] = idx;
        vc_max_into(&cs->f.vc, &cs->f.vc_len, vc, vlen);
    }
    if (out)
        *out = idx;
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------
 * Violations
 * ------------------------------------------------------------------------------------------ */

static void violation(npualloc_graph *g, bool at_capture, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void violation(npualloc_graph *g, bool at_capture, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    set_err("%s", buf);
    pthread_mutex_lock(&viol_lock);
    if (at_capture)
        g->capture_violation = true;
    char *copy = strdup(buf);
    if (copy && GROW(g->viol, g->capviol, g->nviol + 1))
        g->viol[g->nviol++] = copy;
    else
        free(copy);
    pthread_mutex_unlock(&viol_lock);
}

/* ------------------------------------------------------------------------------------------
 * The address registry (runtime checks)
 * ------------------------------------------------------------------------------------------ */

static void reg_add(npualloc_graph *g)
{
    pthread_rwlock_wrlock(&reg_lock);
    /* Ranges of a runtime that was shut down may overlap the new ones: they go first. */
    size_t kept = 0;
    for (size_t i = 0; i < nreg; i++) {
        if (graph_stale(reg[i].g))
            atomic_fetch_sub(&graph_live_ranges, 1);
        else
            reg[kept++] = reg[i];
    }
    nreg = kept;
    if (GROW(reg, capreg, nreg + 1)) {
        size_t i = nreg;
        while (i > 0 && reg[i - 1].base > g->base) {
            reg[i] = reg[i - 1];
            i--;
        }
        reg[i] = (reg_entry){g->base, g->reserved, g};
        nreg++;
        g->registered = true;
        atomic_fetch_add(&graph_live_ranges, 1);
    }
    pthread_rwlock_unlock(&reg_lock);
}

static void reg_remove(npualloc_graph *g)
{
    pthread_rwlock_wrlock(&reg_lock);
    for (size_t i = 0; i < nreg; i++) {
        if (reg[i].g == g) {
            memmove(&reg[i], &reg[i + 1], (nreg - i - 1) * sizeof *reg);
            nreg--;
            g->registered = false;
            atomic_fetch_sub(&graph_live_ranges, 1);
            break;
        }
    }
    pthread_rwlock_unlock(&reg_lock);
}

static void reg_resize(npualloc_graph *g, size_t size)
{
    pthread_rwlock_wrlock(&reg_lock);
    for (size_t i = 0; i < nreg; i++)
        if (reg[i].g == g)
            reg[i].size = size;
    g->reserved = size;
    pthread_rwlock_unlock(&reg_lock);
}

/* The live graph whose range holds address p (reg_lock held), or NULL. */
static npualloc_graph *reg_find_locked(uintptr_t p)
{
    size_t lo = 0, hi = nreg;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (reg[mid].base <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return NULL;
    reg_entry *e = &reg[lo - 1];
    if (p - e->base >= e->size || graph_stale(e->g))
        return NULL;
    return e->g;
}

/* Devices that may access [off, off + n) of a finalised graph's range. */
static uint64_t access_of(const npualloc_graph *g, uint64_t off, uint64_t n)
{
    uint64_t mask = (uint64_t)1 << g->device;
    size_t lo = 0, hi = g->nacc;
    while (lo < hi) { /* first segment ending after off */
        size_t mid = (lo + hi) / 2;
        if (g->acc[mid].end <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t i = lo; i < g->nacc && g->acc[i].start < off + n; i++)
        mask |= g->acc[i].mask;
    return mask;
}

/* Is [off, off + n) inside one output of a finalised graph? */
static bool within_output(const npualloc_graph *g, uint64_t off, uint64_t n)
{
    for (size_t i = 0; i < g->nout; i++)
        if (g->outputs[i].start <= off && off + n <= g->outputs[i].end)
            return true;
    return false;
}

/* The rules for one copy or memset (vmm read lock held): lifetimes of checked graphs (except for
 * `self`, the graph whose launch runs it) and device access. */
static aclError check_rules_locked(const void *dst, range_class dc, int32_t dd, const void *src, range_class sc,
                                   int32_t sd, size_t count, const npualloc_graph *self)
{
    const void *ptrs[2] = {dst, src};
    range_class cls[2] = {dc, sc};
    npualloc_graph *gs[2] = {NULL, NULL};
    uint64_t masks[2] = {0, 0};
    aclError rc = ACL_SUCCESS;
    pthread_rwlock_rdlock(&reg_lock);
    for (int i = 0; i < 2; i++) {
        if (!ptrs[i] || cls[i] != RANGE_DEVICE)
            continue;
        npualloc_graph *g = reg_find_locked((uintptr_t)ptrs[i]);
        if (!g || g->state != G_CAPTURED)
            continue;
        uint64_t off = (uintptr_t)ptrs[i] - g->base;
        gs[i] = g;
        masks[i] = access_of(g, off, count);
        if (g->checked && g != self && !within_output(g, off, count) && rc == ACL_SUCCESS) {
            violation(g, false,
                      "checked graph: %#llx (%zu bytes, graph offset %#llx) is used outside the lifetime of every "
                      "allocation of the graph (only its outputs live after a launch)",
                      (unsigned long long)(uintptr_t)ptrs[i], count, (unsigned long long)off);
            rc = ACL_ERROR_RT_PARAM_INVALID;
        }
    }
    pthread_rwlock_unlock(&reg_lock);
    if (rc != ACL_SUCCESS)
        return rc;
    if (src && dc == RANGE_DEVICE && sc == RANGE_DEVICE && dd >= 0 && sd >= 0 && dd != sd) {
        bool ok;
        if (!gs[0] && !gs[1]) {
            ok = device_peer_enabled(dd, sd);
        } else {
            ok = true;
            if (gs[0] && !((masks[0] >> sd) & 1))
                ok = false;
            if (gs[1] && !((masks[1] >> dd) & 1))
                ok = false;
        }
        if (!ok) {
            set_err("graph memory of device %d is not accessible from device %d", gs[0] ? dd : sd, gs[0] ? sd : dd);
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        }
    }
    return ACL_SUCCESS;
}

aclError graph_check_locked(const void *dst, range_class dc, int32_t dd, const void *src, range_class sc, int32_t sd,
                            size_t count)
{
    return check_rules_locked(dst, dc, dd, src, sc, sd, count, NULL);
}

/* ------------------------------------------------------------------------------------------
 * The planner (graph_lock held)
 * ------------------------------------------------------------------------------------------ */

/* Drops from `active` the allocations whose FREE node every future node descends from. */
static void retire(npualloc_graph *g)
{
    size_t ns = g->nstreams;
    uint32_t floor_stack[16];
    uint32_t *floor = ns <= 16 ? floor_stack : malloc(ns * sizeof *floor);
    if (!floor)
        return;
    for (size_t t = 0; t < ns; t++) {
        uint32_t m = UINT32_MAX;
        for (size_t i = 0; i < g->nstreams; i++)
            m = m < vc_at(g->streams[i].f.vc, g->streams[i].f.vc_len, (uint32_t)t)
                    ? m
                    : vc_at(g->streams[i].f.vc, g->streams[i].f.vc_len, (uint32_t)t);
        for (size_t i = 0; i < g->nevents; i++)
            m = m < vc_at(g->events[i].f.vc, g->events[i].f.vc_len, (uint32_t)t)
                    ? m
                    : vc_at(g->events[i].f.vc, g->events[i].f.vc_len, (uint32_t)t);
        floor[t] = m;
    }
    size_t k = 0;
    for (size_t i = 0; i < g->nactive; i++) {
        const galloc *x = &g->allocs[g->active[i]];
        if (x->free_node != NPUALLOC_GRAPH_NONE && dominated(g, floor, (uint32_t)ns, x->free_node))
            continue;
        g->active[k++] = g->active[i];
    }
    g->nactive = k;
    if (floor != floor_stack)
        free(floor);
}

/* Chooses the offset of a new allocation of `size` bytes whose ALLOC node will follow the
 * frontier f. */
static aclError place(npualloc_graph *g, const frontier *f, uint64_t size, uint64_t *out)
{
    retire(g);
    uint64_t cursor = 0, best_gap = UINT64_MAX, best_off = 0;
    bool found = false;
    for (size_t i = 0; i < g->nactive; i++) {
        const galloc *x = &g->allocs[g->active[i]];
        if (x->free_node != NPUALLOC_GRAPH_NONE && dominated(g, f->vc, f->vc_len, x->free_node))
            continue; /* freed before the new allocation: no conflict */
        if (x->offset > cursor) {
            uint64_t gap = x->offset - cursor;
            if (gap >= size && gap < best_gap) {
                best_gap = gap;
                best_off = cursor;
                found = true;
            }
        }
        if (x->offset + x->size > cursor)
            cursor = x->offset + x->size;
    }
    uint64_t off = found ? best_off : cursor;
    if (off + size > g->reserved || off + size < off) {
        set_err("graph memory of device %d is exhausted: a %llu-byte allocation does not fit in the graph's "
                "%zu-byte address range (the device's memory)",
                g->device, (unsigned long long)size, g->reserved);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    *out = off;
    return ACL_SUCCESS;
}

static bool active_insert(npualloc_graph *g, uint32_t ai)
{
    if (!GROW(g->active, g->capactive, g->nactive + 1))
        return false;
    uint64_t off = g->allocs[ai].offset;
    size_t lo = 0, hi = g->nactive;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g->allocs[g->active[mid]].offset <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    memmove(&g->active[lo + 1], &g->active[lo], (g->nactive - lo) * sizeof *g->active);
    g->active[lo] = ai;
    g->nactive++;
    return true;
}

/* ------------------------------------------------------------------------------------------
 * Capture begin / end
 * ------------------------------------------------------------------------------------------ */

static aclError resolve_stream(aclrtStream stream, int32_t device, npu_stream **out)
{
    return stream ? stream_acquire(stream, out) : stream_acquire_default(device, out);
}

aclError npualloc_graph_create(uint32_t flags, npualloc_graph **out)
{
    if (!out || (flags & ~(uint32_t)NPUALLOC_GRAPH_CHECKED)) {
        set_err("npualloc_graph_create: invalid arguments");
        return ACL_ERROR_INVALID_PARAM;
    }
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS) {
        set_err("the runtime could not start");
        return rc;
    }
    npualloc_graph *g = calloc(1, sizeof *g);
    if (!g)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    g->refs = 1;
    g->gen = npualloc_runtime_generation();
    g->checked = flags & NPUALLOC_GRAPH_CHECKED;
    g->state = G_EMPTY;
    g->device = -1;
    *out = g;
    return ACL_SUCCESS;
}

aclError npualloc_graph_capture_begin(npualloc_graph *g, aclrtStream stream, int32_t device,
                                      const npualloc_capture_params *params)
{
    if (!g)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npualloc_capture_params p = params ? *params : (npualloc_capture_params){0};
    if ((unsigned)p.mode > ACL_MODEL_RI_CAPTURE_MODE_RELAXED) { /* CANN's runtime checks it first */
        set_err("capture_begin: %d is not a capture mode", (int)p.mode);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (graph_stale(g)) {
        set_err("the graph belongs to a runtime that was shut down");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&graph_lock);
    bool empty = g->state == G_EMPTY;
    if (empty)
        g->state = G_CAPTURING; /* claimed: a concurrent begin on the same graph fails */
    pthread_mutex_unlock(&graph_lock);
    if (!empty) {
        set_err("a graph is captured once: this one is %s",
                g->state == G_CAPTURING ? "being captured"
                : g->state == G_ENDING  ? "ending its capture"
                : g->state == G_BROKEN  ? "broken (its capture failed: reset() it, or make a new one)"
                                        : "captured");
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    npu_stream *s;
    if ((rc = resolve_stream(stream, device, &s)) != ACL_SUCCESS) {
        set_err("capture_begin: not a live stream");
        goto unclaim;
    }
    int32_t dev = stream_device(s);
    if (p.has_access && (p.access_mask >> 1 >> (device_count() - 1)) != 0) {
        set_err("capture_begin: the access mask names devices that do not exist");
        rc = ACL_ERROR_INVALID_PARAM;
        goto unpin;
    }
    uintptr_t base = 0;
    size_t reserved = 0;
    if (p.use_pool) {
        /* torch's beginAllocateToPool: one reference for the recording, which the graph keeps
         * from capture_end on (routes of streams joining the capture take none). */
        rc = npualloc_cache_pool_begin(dev, p.pool, NPUALLOC_POOL_FILTER_STREAM, stream_id(s));
        if (rc != ACL_SUCCESS) {
            set_err("capture_begin: %s", npualloc_last_error(NULL));
            goto unpin;
        }
    } else {
        reserved = round_up((size_t)device_config()->device_memory, VMM_GRANULARITY);
        if (reserved == 0)
            reserved = VMM_GRANULARITY;
        void *va;
        /* the runtime's own range: the program cannot unmap or release the graph's memory */
        if ((rc = vmm_reserve_private(dev, reserved, &va)) != ACL_SUCCESS) {
            set_err("capture_begin: no address space for the graph's memory (%zu bytes)", reserved);
            goto unpin;
        }
        base = (uintptr_t)va;
    }
    pthread_mutex_lock(&graph_lock);
    bool already = stream_capture_get(s) != NULL;
    if (already || !GROW(g->streams, g->capstreams, 1)) {
        pthread_mutex_unlock(&graph_lock);
        if (already) {
            set_err("capture_begin: the stream is already capturing");
            rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        } else {
            set_err("capture_begin: out of host memory");
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        }
        if (p.use_pool)
            (void)npualloc_cache_pool_end(dev, p.pool);
        else
            (void)vmm_release_private((void *)base);
        goto unpin;
    }
    g->device = dev;
    g->base = base;
    g->reserved = reserved;
    g->pool_mode = p.use_pool;
    g->pool = p.pool;
    g->has_access = p.has_access;
    g->access = p.access_mask;
    g->mode = p.mode;
    g->cap_thread = host_thread_serial();
    g->streams[0] = (cap_stream){.s = s, .handle = stream_id(s), .device = dev, .routed = p.use_pool};
    g->nstreams = 1;
    stream_capture_set(s, g);
    atomic_fetch_add(&graph_capturing_streams, 1);
    g->cap_next = capturing;
    capturing = g;
    pthread_mutex_unlock(&graph_lock);
    if (!p.use_pool)
        reg_add(g);
    return ACL_SUCCESS;
unpin:
    stream_release(s);
unclaim:
    pthread_mutex_lock(&graph_lock);
    g->state = G_EMPTY;
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

static void finalize(npualloc_graph *g);
static npualloc_graph *live_capture(npualloc_graph *c);

aclError npualloc_graph_capture_end(npualloc_graph *g)
{
    if (!g)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&graph_lock);
    if (g->state != G_CAPTURING || g->nstreams == 0) {
        pthread_mutex_unlock(&graph_lock);
        set_err("capture_end: the graph is not being captured");
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    /* A graph of a runtime that was shut down: its address range and pool routes went with that
     * runtime, and the new runtime may hand out the same addresses and pool ids, so the capture
     * ends broken without finalizing, trimming, releasing or ending anything; its streams (kept
     * alive by their pins) only leave capture mode. */
    bool stale = graph_stale(g);
    aclError rc = ACL_SUCCESS;
    if (stale) {
        set_err("capture_end: the graph belongs to a runtime that was shut down");
        rc = ACL_ERROR_INVALID_PARAM;
    } else if (g->mode != ACL_MODEL_RI_CAPTURE_MODE_RELAXED && g->cap_thread != host_thread_serial()) {
        /* CANN's aclmdlRICaptureEnd: such a capture ends in its thread; elsewhere it ends broken */
        set_err("capture_end: a capture not begun in RELAXED mode ends in the thread that began it");
        rc = ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD;
    }
    /* Every joined stream must have been joined back into the origin stream. */
    const frontier *origin = &g->streams[0].f;
    for (size_t i = 1; i < g->nstreams && rc == ACL_SUCCESS; i++) {
        const frontier *f = &g->streams[i].f;
        for (uint32_t k = 0; k < f->n; k++) {
            if (!dominated(g, origin->vc, origin->vc_len, f->nodes[k])) {
                set_err("capture_end: stream %#llx joined the capture and was not joined back (the capturing "
                        "stream must wait for an event recorded after its last work)",
                        (unsigned long long)g->streams[i].handle);
                rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
                break;
            }
        }
    }
    for (size_t i = 0; i < g->nstreams; i++) {
        stream_capture_set(g->streams[i].s, NULL);
        atomic_fetch_sub(&graph_capturing_streams, 1);
    }
    for (npualloc_graph **pp = &capturing; *pp; pp = &(*pp)->cap_next) {
        if (*pp == g) {
            *pp = g->cap_next;
            break;
        }
    }
    for (size_t i = 0; i < g->nevents; i++)
        frontier_free(&g->events[i].f);
    g->nevents = 0;
    /* Not G_CAPTURED yet: instantiate refuses the graph until the range is trimmed (below). */
    bool ending = rc == ACL_SUCCESS;
    g->state = ending ? G_ENDING : G_BROKEN;
    /* The streams and their pool routes are ended below, with graph_lock dropped, straight from g->streams:
     * nothing else changes them once the graph left G_CAPTURING (but a join still taking its route, waited
     * for below), and so the end asks for no memory (it copied them into two lists, and out of
     * host memory left the routes for ever). */
    size_t ns = g->nstreams;
    for (size_t i = 0; i < ns; i++)
        frontier_free(&g->streams[i].f);
    if (rc == ACL_SUCCESS && !g->pool_mode)
        finalize(g);
    /* A join still taking its route (no new one: g left the capturing list). */
    while (g->joining)
        pthread_cond_wait(&join_cv, &graph_lock);
    pthread_mutex_unlock(&graph_lock);
    /* torch's endAllocateToPool keeps beginAllocateToPool's reference for the graph, which
     * releases it when it goes (releasePool): the graph takes its own before the recording's
     * route ends and gives that one back. */
    if (g->pool_mode && !stale)
        g->pool_ref = npualloc_cache_pool_create(g->device, g->pool) == ACL_SUCCESS;
    for (size_t i = 0; i < ns; i++) {
        if (g->streams[i].routed && !stale)
            (void)npualloc_cache_pool_end(stream_device(g->streams[i].s), g->pool);
        g->streams[i].routed = false;
        stream_release(g->streams[i].s);
        g->streams[i].s = NULL;
    }
    /* Trim the address range to what the plan maps (nothing is mapped yet: the graph is G_ENDING, so
     * no executable graph of it exists). */
    if (rc == ACL_SUCCESS && !g->pool_mode) {
        size_t want = g->mapped ? (size_t)g->mapped : VMM_GRANULARITY;
        if (want < g->reserved) {
            reg_resize(g, want);
            if (vmm_reserve_shrink((void *)g->base, want) != ACL_SUCCESS) {
                (void)vmm_release_private((void *)g->base);
                reg_remove(g);
                set_err("capture_end: the graph's address range could not be kept");
                rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
            }
        }
    }
    /* Published last: from here on the graph may be instantiated and launched. */
    if (ending) {
        pthread_mutex_lock(&graph_lock);
        if (rc != ACL_SUCCESS)
            g->base = 0;
        g->state = rc == ACL_SUCCESS ? G_CAPTURED : G_BROKEN;
        pthread_mutex_unlock(&graph_lock);
    }
    return rc;
}

aclError npualloc_stream_capture_status(aclrtStream stream, int32_t device, bool *is_capturing, npualloc_graph **graph)
{
    if (!is_capturing)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = resolve_stream(stream, device, &s)) != ACL_SUCCESS)
        return rc;
    npualloc_graph *g = stream_capture_get(s);
    *is_capturing = g != NULL;
    if (graph)
        *graph = g;
    stream_release(s);
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------
 * Capture modes (acl_rt.h)
 * ------------------------------------------------------------------------------------------ */

/* aclmdlRICaptureThreadExchangeMode's setting; CANN starts every thread at GLOBAL (0). */
static _Thread_local aclmdlRICaptureMode exchange_mode;

aclError aclmdlRICaptureThreadExchangeMode(aclmdlRICaptureMode *mode)
{
    if (!mode)
        return ACL_ERROR_INVALID_PARAM;
    if ((unsigned)*mode > ACL_MODEL_RI_CAPTURE_MODE_RELAXED)
        return ACL_ERROR_RT_PARAM_INVALID;
    int32_t dev;
    aclError rc = runtime_current_device(&dev); /* CANN keeps the setting through the current context */
    if (rc != ACL_SUCCESS)
        return rc;
    aclmdlRICaptureMode old = exchange_mode;
    exchange_mode = *mode;
    *mode = old;
    return ACL_SUCCESS;
}

/* CANN's rule (its runtime's CaptureSession::IsCaptureModeSupport): the strictest mode among the
 * captures underway on the current device and among those the calling thread began, against the
 * thread's exchange mode.  A thread without a current device has no capture to answer to. */
aclError graph_unsafe_call_check(void)
{
    enum { NONE = ACL_MODEL_RI_CAPTURE_MODE_RELAXED + 1 };
    aclmdlRICaptureMode ex = exchange_mode;
    int32_t dev;
    if (ex == ACL_MODEL_RI_CAPTURE_MODE_RELAXED || device_current(&dev) != ACL_SUCCESS)
        return ACL_SUCCESS;
    uint64_t self = host_thread_serial();
    unsigned on_device = NONE, mine = NONE;
    pthread_mutex_lock(&graph_lock);
    for (npualloc_graph *c = live_capture(capturing); c; c = live_capture(c->cap_next)) {
        if (c->device == dev && (unsigned)c->mode < on_device)
            on_device = c->mode;
        if (c->cap_thread == self && (unsigned)c->mode < mine)
            mine = c->mode;
    }
    pthread_mutex_unlock(&graph_lock);
    if (on_device == NONE)
        return ACL_SUCCESS;
    bool refused = ex == ACL_MODEL_RI_CAPTURE_MODE_GLOBAL
                       ? on_device == ACL_MODEL_RI_CAPTURE_MODE_GLOBAL || mine == ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL
                       : mine <= ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL;
    return refused ? ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT : ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------
 * Hooks: stream tasks, events
 * ------------------------------------------------------------------------------------------ */

bool graph_capture_task(npu_stream *s, int kind, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                        aclError *rc)
{
    pthread_mutex_lock(&graph_lock);
    npualloc_graph *g = stream_capture_get(s);
    int si = g ? stream_index(g, s) : -1;
    if (si < 0) {
        pthread_mutex_unlock(&graph_lock);
        return false;
    }
    gnode proto = {.kind = kind == GRAPH_TASK_HOST    ? NPUALLOC_GRAPH_NODE_HOST
                           : kind == GRAPH_TASK_DELAY ? NPUALLOC_GRAPH_NODE_DELAY
                                                      : NPUALLOC_GRAPH_NODE_TASK,
                   .alloc = NPUALLOC_GRAPH_NONE,
                   .fn = fn,
                   .arg = arg,
                   .cleanup = cleanup};
    *rc = add_node(g, (uint32_t)si, NULL, 0, &proto, NULL);
    pthread_mutex_unlock(&graph_lock);
    return true;
}

static cap_event *find_event(npualloc_graph *g, uint64_t handle)
{
    for (size_t i = 0; i < g->nevents; i++)
        if (g->events[i].handle == handle)
            return &g->events[i];
    return NULL;
}

/* c or the next capturing graph of the running runtime (graph_lock held).  A graph that was capturing
 * when the runtime shut down stays listed until its capture ends, but its events and addresses are
 * not the new runtime's: the new runtime's handles never match them, and its address ranges may sit
 * where the old graph's did. */
static npualloc_graph *live_capture(npualloc_graph *c)
{
    while (c && graph_stale(c))
        c = c->cap_next;
    return c;
}

bool graph_capture_record(npu_stream *s, uint64_t event, aclError *rc)
{
    pthread_mutex_lock(&graph_lock);
    npualloc_graph *g = stream_capture_get(s);
    int si = g ? stream_index(g, s) : -1;
    if (si < 0) {
        /* A record outside every capture supersedes the event's captured records. */
        for (npualloc_graph *c = live_capture(capturing); c; c = live_capture(c->cap_next)) {
            cap_event *e = find_event(c, event);
            if (e) {
                frontier_free(&e->f);
                *e = c->events[--c->nevents];
            }
        }
        pthread_mutex_unlock(&graph_lock);
        return false;
    }
    /* The record is the event's, in whichever capture it was recorded before. */
    for (npualloc_graph *c = live_capture(capturing); c; c = live_capture(c->cap_next)) {
        cap_event *e = c != g ? find_event(c, event) : NULL;
        if (e) {
            frontier_free(&e->f);
            *e = c->events[--c->nevents];
        }
    }
    cap_event *e = find_event(g, event);
    if (!e) {
        if (!GROW(g->events, g->capevents, g->nevents + 1)) {
            pthread_mutex_unlock(&graph_lock);
            *rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
            return true;
        }
        e = &g->events[g->nevents++];
        *e = (cap_event){.handle = event};
    }
    *rc = frontier_copy(&e->f, &g->streams[si].f) ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_mutex_unlock(&graph_lock);
    return true;
}

bool graph_capture_wait(npu_stream *s, uint64_t event, aclError *rc)
{
    pthread_mutex_lock(&graph_lock);
    npualloc_graph *g = stream_capture_get(s), *owner = NULL;
    cap_event *e = NULL;
    for (npualloc_graph *c = live_capture(capturing); c && !e; c = live_capture(c->cap_next))
        if ((e = find_event(c, event)))
            owner = c;
    if (!e) {
        pthread_mutex_unlock(&graph_lock);
        if (!g)
            return false;
        *rc = ACL_SUCCESS; /* an event from outside the capture: the graph cannot wait for it */
        return true;
    }
    if (g && g != owner) {
        pthread_mutex_unlock(&graph_lock);
        set_err("stream_wait_event: the event was recorded in another capture");
        *rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        return true;
    }
    bool route = false;
    npualloc_mempool_id pool = owner->pool;
    int32_t dev = stream_device(s);
    if (!g) { /* the stream joins the capture */
        if (!GROW(owner->streams, owner->capstreams, owner->nstreams + 1)) {
            pthread_mutex_unlock(&graph_lock);
            *rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
            return true;
        }
        stream_pin(s);
        route = owner->pool_mode && dev == owner->device;
        owner->streams[owner->nstreams++] = (cap_stream){.s = s, .handle = stream_id(s), .device = dev, .routed = route};
        stream_capture_set(s, owner);
        atomic_fetch_add(&graph_capturing_streams, 1);
        g = owner;
        if (route)
            g->joining++;
    }
    int si = stream_index(g, s);
    *rc = frontier_merge(g, &g->streams[si].f, &e->f) ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_mutex_unlock(&graph_lock);
    if (route) {
        bool joined = npualloc_cache_pool_join(dev, pool, stream_id(s)) == ACL_SUCCESS;
        pthread_mutex_lock(&graph_lock);
        int k = stream_index(g, s);
        if (!joined && k >= 0)
            g->streams[k].routed = false;
        if (--g->joining == 0)
            pthread_cond_broadcast(&join_cv); /* capture_end may wait for it */
        pthread_mutex_unlock(&graph_lock);
    }
    return true;
}

/* ------------------------------------------------------------------------------------------
 * Hooks: memory operations
 * ------------------------------------------------------------------------------------------ */

static bool in_graph_range(const npualloc_graph *g, const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    return !g->pool_mode && g->base && a >= g->base && a - g->base < g->reserved && n <= g->reserved - (a - g->base);
}

static bool overlaps_graph_range(const npualloc_graph *g, const void *p, size_t n)
{
    uintptr_t a = (uintptr_t)p;
    return !g->pool_mode && g->base && a < g->base + g->reserved && a + n > g->base;
}

/* The allocation live at a node following frontier f that covers [off, off + n), or -1. */
static long live_alloc(const npualloc_graph *g, const frontier *f, uint64_t off, uint64_t n)
{
    for (size_t i = 0; i < g->nactive; i++) {
        const galloc *x = &g->allocs[g->active[i]];
        if (x->offset > off)
            break;
        if (off + n <= x->offset + x->size && x->free_node == NPUALLOC_GRAPH_NONE &&
            dominated(g, f->vc, f->vc_len, x->node))
            return (long)g->active[i];
    }
    return -1;
}

/* Why no live allocation covers [off, off + n): a message for the violation log. */
static void describe_dead(const npualloc_graph *g, const frontier *f, uint64_t off, uint64_t n, char *buf, size_t len)
{
    for (size_t i = g->nallocs; i-- > 0;) {
        const galloc *x = &g->allocs[i];
        if (off >= x->offset && off < x->offset + x->size) {
            const char *why = x->free_node != NPUALLOC_GRAPH_NONE ? "after (or concurrently with) its free at node"
                              : !dominated(g, f->vc, f->vc_len, x->node) ? "not ordered after its allocation at node"
                                                                          : "beyond its end; allocated at node";
            uint32_t at = x->free_node != NPUALLOC_GRAPH_NONE ? x->free_node : x->node;
            snprintf(buf, len, "allocation #%zu (offset %#llx, %llu bytes) is used %s %u", i,
                     (unsigned long long)x->offset, (unsigned long long)x->size, why, at);
            return;
        }
    }
    snprintf(buf, len, "graph offset %#llx (%llu bytes) lies in no allocation", (unsigned long long)off,
             (unsigned long long)n);
}

/* The devices that may access graph memory [off, off + n) during capture (unchecked graphs):
 * the union of the allocations overlapping it. */
static uint64_t capture_access(const npualloc_graph *g, uint64_t off, uint64_t n)
{
    uint64_t mask = (uint64_t)1 << g->device;
    for (size_t i = 0; i < g->nallocs; i++) {
        const galloc *x = &g->allocs[i];
        if (x->offset < off + n && off < x->offset + x->size)
            mask |= x->access;
    }
    return mask;
}

static bool add_use(galloc *x, uint32_t node)
{
    if (!GROW(x->uses, x->capuses, (size_t)x->nuses + 1))
        return false;
    x->uses[x->nuses++] = node;
    return true;
}

bool graph_capture_memop(aclrtStream stream, void *dst, const void *src, size_t count, int32_t value, bool copy,
                         aclError *rc)
{
    npu_stream *s;
    if (stream_acquire(stream, &s) != ACL_SUCCESS)
        return false; /* the normal path reports the bad handle */
    if (!stream_capture_get(s)) {
        stream_release(s);
        return false;
    }
    /* Classify the pointers first (the vmm lock is never taken under graph_lock), and apply the
     * ordinary rules (other checked graphs' lifetimes, device access) to the operands that are
     * valid memory: this capture's range is not mapped until launch, so an operand there is
     * RANGE_INVALID and left to the capture's own checks below, while the other operand (say,
     * another checked graph's freed range) still answers to its rules. */
    const void *ptrs[2] = {dst, copy ? src : NULL};
    range_class cls[2] = {RANGE_INVALID, RANGE_INVALID};
    int32_t devs[2] = {-1, -1};
    const void *valid[2] = {NULL, NULL};
    vmm_read_lock();
    for (int i = 0; i < 2; i++) {
        if (ptrs[i])
            cls[i] = vmm_classify_locked(ptrs[i], count, &devs[i]);
        if (cls[i] != RANGE_INVALID)
            valid[i] = ptrs[i];
    }
    aclError other_rc = ACL_SUCCESS;
    if (valid[0] || valid[1])
        other_rc = check_rules_locked(valid[0], cls[0], devs[0], valid[1], cls[1], devs[1], count, NULL);
    vmm_read_unlock();

    pthread_mutex_lock(&graph_lock);
    npualloc_graph *g = stream_capture_get(s);
    int si = g ? stream_index(g, s) : -1;
    if (si < 0) {
        pthread_mutex_unlock(&graph_lock);
        stream_release(s);
        return false;
    }
    const frontier *f = &g->streams[si].f;
    bool mine[2] = {false, false};
    uint64_t masks[2] = {0, 0};
    long users[2] = {-1, -1};
    aclError r = ACL_SUCCESS;
    for (int i = 0; i < 2 && r == ACL_SUCCESS; i++) {
        if (!ptrs[i])
            continue;
        if (!in_graph_range(g, ptrs[i], count)) {
            if (overlaps_graph_range(g, ptrs[i], count) || cls[i] == RANGE_INVALID) {
                set_err("graph capture: %p (%zu bytes) is not valid memory", ptrs[i], count);
                r = ACL_ERROR_RT_PARAM_INVALID;
            }
            continue;
        }
        mine[i] = true;
        devs[i] = g->device;
        uint64_t off = (uintptr_t)ptrs[i] - g->base;
        if (g->checked) {
            users[i] = live_alloc(g, f, off, count);
            if (users[i] < 0) {
                char why[256];
                describe_dead(g, f, off, count, why, sizeof why);
                violation(g, true, "checked graph: %s %p (%zu bytes) at capture: %s", copy ? "memcpy of" : "memset of",
                          ptrs[i], count, why);
                r = ACL_ERROR_RT_PARAM_INVALID;
                break;
            }
            masks[i] = g->allocs[users[i]].access;
        } else {
            masks[i] = capture_access(g, off, count);
        }
    }
    if (r == ACL_SUCCESS && other_rc != ACL_SUCCESS)
        r = other_rc;
    if (r == ACL_SUCCESS && copy && (mine[0] || mine[1])) {
        /* Device access: the capture's memory by its allocations' access, other memory as usual. */
        bool dev_side[2] = {mine[0] || cls[0] == RANGE_DEVICE, mine[1] || cls[1] == RANGE_DEVICE};
        if (dev_side[0] && dev_side[1] && devs[0] >= 0 && devs[1] >= 0 && devs[0] != devs[1]) {
            bool ok = true;
            if (mine[0] && !((masks[0] >> devs[1]) & 1))
                ok = false;
            if (mine[1] && !((masks[1] >> devs[0]) & 1))
                ok = false;
            if (!mine[0] || !mine[1]) {
                /* the other side may itself be another graph's memory */
                int o = mine[0] ? 1 : 0;
                pthread_rwlock_rdlock(&reg_lock);
                npualloc_graph *og = reg_find_locked((uintptr_t)ptrs[o]);
                if (og && og != g && og->state == G_CAPTURED &&
                    !((access_of(og, (uintptr_t)ptrs[o] - og->base, count) >> devs[1 - o]) & 1))
                    ok = false;
                pthread_rwlock_unlock(&reg_lock);
            }
            if (!ok) {
                set_err("graph capture: graph memory of device %d is not accessible from device %d (its access was "
                        "fixed when it was allocated)",
                        g->device, mine[0] ? devs[1] : devs[0]);
                r = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
            }
        }
    }
    if (r == ACL_SUCCESS) {
        gnode proto = {.kind = copy ? NPUALLOC_GRAPH_NODE_MEMCPY : NPUALLOC_GRAPH_NODE_MEMSET,
                       .alloc = NPUALLOC_GRAPH_NONE,
                       .dst = dst,
                       .src = copy ? src : NULL,
                       .count = count,
                       .value = value,
                       .arg = g}; /* (run_mem_node: the graph whose launch runs it) */
        uint32_t node;
        r = add_node(g, (uint32_t)si, NULL, 0, &proto, &node);
        for (int i = 0; i < 2 && r == ACL_SUCCESS; i++)
            if (users[i] >= 0 && (i == 0 || users[1] != users[0]) && !add_use(&g->allocs[users[i]], node))
                r = ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    pthread_mutex_unlock(&graph_lock);
    stream_release(s);
    *rc = r;
    return true;
}

/* ------------------------------------------------------------------------------------------
 * Hooks: allocation, free, record_stream
 * ------------------------------------------------------------------------------------------ */


bool graph_capture_malloc(int32_t device, size_t size, uint64_t stream, void **ptr, aclError *rc)
{
    npu_stream *s;
    if (!device_valid(device) || stream_acquire_id(device, stream, &s) != ACL_SUCCESS)
        return false;
    if (!stream_capture_get(s)) {
        stream_release(s);
        return false;
    }
    pthread_mutex_lock(&graph_lock);
    npualloc_graph *g = stream_capture_get(s);
    int si = g ? stream_index(g, s) : -1;
    if (si < 0 || g->pool_mode) { /* ended meanwhile, or a pool capture: the cache serves it */
        pthread_mutex_unlock(&graph_lock);
        stream_release(s);
        return false;
    }
    aclError r = ACL_SUCCESS;
    if (device != g->device || stream_device(s) != g->device) {
        cache_set_error(NPUALLOC_ERR_RUNTIME,
                        "graph capture: an allocation on device %d in a graph of device %d (a graph holds the "
                        "memory of one device)",
                        device, g->device);
        r = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    } else if (size > ((uint64_t)1 << 60)) {
        cache_set_error(NPUALLOC_ERR_OOM, "graph capture: a %zu-byte allocation cannot fit in graph memory", size);
        r = ACL_ERROR_RT_DEVICE_OOM;
    }
    uint64_t rsize = round_up(size, ALLOC_ALIGN), off = 0;
    if (r == ACL_SUCCESS && (r = place(g, &g->streams[si].f, rsize, &off)) != ACL_SUCCESS) {
        cache_set_error(NPUALLOC_ERR_OOM, "%s", last_err);
        r = ACL_ERROR_RT_DEVICE_OOM; /* OutOfMemoryError without the caching allocator's OOM report */
    }
    if (r == ACL_SUCCESS && (!GROW(g->allocs, g->capallocs, g->nallocs + 1) || !GROW(g->active, g->capactive, g->nactive + 1))) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for a graph node");
        r = ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    uint32_t node = 0;
    uint32_t ai = (uint32_t)g->nallocs;
    if (r == ACL_SUCCESS) {
        gnode proto = {.kind = NPUALLOC_GRAPH_NODE_ALLOC, .alloc = ai};
        if ((r = add_node(g, (uint32_t)si, NULL, 0, &proto, &node)) != ACL_SUCCESS)
            cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for a graph node");
    }
    if (r == ACL_SUCCESS) {
        uint64_t access = g->has_access ? g->access : access_setting(g->device);
        g->allocs[g->nallocs++] = (galloc){.offset = off,
                                           .size = rsize,
                                           .requested = size,
                                           .node = node,
                                           .free_node = NPUALLOC_GRAPH_NONE,
                                           .stream = (uint32_t)si,
                                           .access = access | ((uint64_t)1 << g->device)};
        active_insert(g, ai); /* room was made above */
        if (off + rsize > g->footprint)
            g->footprint = off + rsize;
        *ptr = (void *)(g->base + off);
    }
    pthread_mutex_unlock(&graph_lock);
    stream_release(s);
    *rc = r;
    return true;
}

/* The unfreed allocation of a capturing graph that starts at p (graph_lock held). */
static npualloc_graph *capturing_owner(const void *p, long *ai)
{
    for (npualloc_graph *g = live_capture(capturing); g; g = live_capture(g->cap_next)) {
        if (!in_graph_range(g, p, 1))
            continue;
        uint64_t off = (uintptr_t)p - g->base;
        *ai = -1;
        for (size_t i = g->nallocs; i-- > 0;) {
            if (g->allocs[i].offset == off && g->allocs[i].free_node == NPUALLOC_GRAPH_NONE) {
                *ai = (long)i;
                break;
            }
        }
        return g;
    }
    return NULL;
}

bool graph_free(void *ptr, aclError *rc)
{
    pthread_mutex_lock(&graph_lock);
    long ai = -1;
    npualloc_graph *g = capturing_owner(ptr, &ai);
    if (g) {
        if (ai < 0) {
            pthread_mutex_unlock(&graph_lock);
            cache_set_error(NPUALLOC_ERR_RUNTIME, "graph capture: %p is not a live allocation of the graph "
                                                  "(freed twice, or not the start of an allocation)", ptr);
            *rc = ACL_ERROR_INVALID_PARAM;
            return true;
        }
        galloc *x = &g->allocs[ai];
        gnode proto = {.kind = NPUALLOC_GRAPH_NODE_FREE, .alloc = (uint32_t)ai};
        uint32_t node;
        aclError r = add_node(g, x->stream, x->rec, x->nrec, &proto, &node);
        if (r == ACL_SUCCESS) {
            x = &g->allocs[ai];
            x->free_node = node;
            if (g->checked) {
                for (uint32_t i = 0; i < x->nuses; i++) {
                    if (!reaches(g, x->uses[i], node)) {
                        violation(g, true,
                                  "checked graph: allocation #%ld (offset %#llx, %llu bytes) is freed at node %u "
                                  "while its use at node %u on another stream may still run (record_stream or an "
                                  "event is missing)",
                                  ai, (unsigned long long)x->offset, (unsigned long long)x->size, node, x->uses[i]);
                        break;
                    }
                }
            }
        } else {
            cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for a graph node");
        }
        pthread_mutex_unlock(&graph_lock);
        *rc = r;
        return true;
    }
    pthread_mutex_unlock(&graph_lock);
    /* Memory of a graph whose capture ended: it goes with the graph. */
    pthread_rwlock_rdlock(&reg_lock);
    bool known = reg_find_locked((uintptr_t)ptr) != NULL;
    pthread_rwlock_unlock(&reg_lock);
    if (known)
        *rc = ACL_SUCCESS;
    return known;
}

bool graph_record_stream(void *ptr, uint64_t stream, aclError *rc)
{
    npu_stream *s = NULL;
    pthread_mutex_lock(&graph_lock);
    long ai = -1;
    npualloc_graph *g = capturing_owner(ptr, &ai);
    if (!g) {
        pthread_mutex_unlock(&graph_lock);
        return false;
    }
    aclError r = ACL_SUCCESS;
    if (ai < 0) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "record_stream: %p is not a live allocation of the graph", ptr);
        r = ACL_ERROR_INVALID_PARAM;
    }
    int32_t dev = g->device;
    pthread_mutex_unlock(&graph_lock);
    if (r == ACL_SUCCESS && stream_acquire_id(dev, stream, &s) != ACL_SUCCESS) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "record_stream: %#llx is not a live stream", (unsigned long long)stream);
        r = ACL_ERROR_INVALID_PARAM;
    }
    if (r == ACL_SUCCESS) {
        pthread_mutex_lock(&graph_lock);
        long again = -1;
        npualloc_graph *g2 = capturing_owner(ptr, &again);
        int si = g2 == g && again == ai ? stream_index(g, s) : -1;
        if (si < 0) {
            cache_set_error(NPUALLOC_ERR_RUNTIME, "record_stream: the stream is not part of the graph's capture");
            r = ACL_ERROR_INVALID_PARAM;
        } else {
            galloc *x = &g->allocs[ai];
            bool have = false;
            for (uint32_t i = 0; i < x->nrec; i++)
                have |= x->rec[i] == (uint32_t)si;
            if (!have && !(GROW(x->rec, x->caprec, (size_t)x->nrec + 1) && (x->rec[x->nrec++] = (uint32_t)si, true)))
                r = ACL_ERROR_RT_MEMORY_ALLOCATION;
        }
        pthread_mutex_unlock(&graph_lock);
        stream_release(s);
    }
    *rc = r;
    return true;
}

/* ------------------------------------------------------------------------------------------
 * Finalising the plan (graph_lock held)
 * ------------------------------------------------------------------------------------------ */

static bool before(const npualloc_graph *g, uint32_t free_node, uint32_t alloc_node)
{
    return free_node != NPUALLOC_GRAPH_NONE && reaches(g, free_node, alloc_node);
}

static bool conflict(const npualloc_graph *g, const galloc *x, const galloc *y)
{
    return !before(g, x->free_node, y->node) && !before(g, y->free_node, x->node);
}

static const npualloc_graph *sort_graph;
static int by_size_desc(const void *a, const void *b)
{
    uint64_t x = sort_graph->allocs[*(const uint32_t *)a].size, y = sort_graph->allocs[*(const uint32_t *)b].size;
    return (x < y) - (x > y);
}

/* Grows a clique (pairwise conflicting allocations, `in` marks them) greedily, largest first. */
static uint64_t grow_clique(const npualloc_graph *g, const uint32_t *order, uint32_t *clique, size_t n, bool *in,
                            uint64_t weight)
{
    size_t k = n;
    for (size_t i = 0; i < g->nallocs; i++) {
        uint32_t c = order[i];
        if (in[c])
            continue;
        bool ok = true;
        for (size_t j = 0; j < k && ok; j++)
            ok = conflict(g, &g->allocs[c], &g->allocs[clique[j]]);
        if (ok) {
            clique[k++] = c;
            in[c] = true;
            weight += g->allocs[c].size;
        }
    }
    for (size_t j = 0; j < k; j++)
        in[clique[j]] = false;
    return weight;
}

/* A sound lower bound: the weight of a set of pairwise conflicting allocations. */
static uint64_t lower_bound(const npualloc_graph *g)
{
    /* The live set at the peak of capture order (a linear extension): pairwise conflicting. */
    uint64_t cur = 0, best = 0;
    size_t best_at = 0;
    for (size_t i = 0; i < g->nnodes; i++) {
        const gnode *n = &g->nodes[i];
        if (n->kind == NPUALLOC_GRAPH_NODE_ALLOC) {
            cur += g->allocs[n->alloc].size;
            if (cur > best) {
                best = cur;
                best_at = i;
            }
        } else if (n->kind == NPUALLOC_GRAPH_NODE_FREE) {
            cur -= g->allocs[n->alloc].size;
        }
    }
    if (g->nstreams <= 1 || g->nallocs == 0)
        return best; /* a chain: the live sets are all the cliques there are */
    uint32_t *order = malloc(g->nallocs * sizeof *order);
    uint32_t *clique = malloc(g->nallocs * sizeof *clique);
    bool *in = calloc(g->nallocs, sizeof *in);
    if (!order || !clique || !in)
        goto out;
    for (size_t i = 0; i < g->nallocs; i++)
        order[i] = (uint32_t)i;
    sort_graph = g;
    qsort(order, g->nallocs, sizeof *order, by_size_desc);
    size_t n = 0;
    uint64_t w = 0;
    for (size_t i = 0; i < g->nallocs; i++) {
        const galloc *x = &g->allocs[i];
        if (x->node <= best_at && (x->free_node == NPUALLOC_GRAPH_NONE || x->free_node > best_at)) {
            clique[n++] = (uint32_t)i;
            in[i] = true;
            w += x->size;
        }
    }
    uint64_t grown = grow_clique(g, order, clique, n, in, w);
    if (grown > best)
        best = grown;
    if (g->nallocs <= LB_ALL_SEEDS_LIMIT) {
        for (size_t i = 0; i < g->nallocs; i++) {
            clique[0] = (uint32_t)i;
            in[i] = true;
            uint64_t c = grow_clique(g, order, clique, 1, in, g->allocs[i].size);
            if (c > best)
                best = c;
        }
    }
out:
    free(order);
    free(clique);
    free(in);
    return best;
}

static int acc_event_order(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

static int range_order(const void *a, const void *b)
{
    const range64 *x = a, *y = b;
    return (x->start > y->start) - (x->start < y->start);
}

/* The runtime access map: for each stretch of the range, the union of the access masks of the
 * allocations overlapping it. */
static void build_access_map(npualloc_graph *g)
{
    size_t ne = 2 * g->nallocs;
    uint64_t(*ev)[3] = malloc((ne ? ne : 1) * sizeof *ev); /* (position, +1/-1 as 1/0, alloc) */
    acc_seg *segs = malloc((ne ? ne : 1) * sizeof *segs);
    if (!ev || !segs) {
        free(ev);
        free(segs);
        return;
    }
    for (size_t i = 0; i < g->nallocs; i++) {
        ev[2 * i][0] = g->allocs[i].offset;
        ev[2 * i][1] = 1;
        ev[2 * i][2] = i;
        ev[2 * i + 1][0] = g->allocs[i].offset + g->allocs[i].size;
        ev[2 * i + 1][1] = 0;
        ev[2 * i + 1][2] = i;
    }
    qsort(ev, ne, sizeof *ev, acc_event_order);
    uint32_t counts[64] = {0};
    size_t ns = 0;
    for (size_t i = 0; i < ne;) {
        uint64_t pos = ev[i][0];
        for (; i < ne && ev[i][0] == pos; i++) {
            uint64_t m = g->allocs[ev[i][2]].access;
            for (int d = 0; d < 64; d++)
                if ((m >> d) & 1)
                    counts[d] += ev[i][1] ? 1 : (uint32_t)-1;
        }
        uint64_t mask = 0;
        for (int d = 0; d < 64; d++)
            if (counts[d])
                mask |= (uint64_t)1 << d;
        if (i < ne && mask) {
            uint64_t next = ev[i][0];
            if (ns && segs[ns - 1].end == pos && segs[ns - 1].mask == mask)
                segs[ns - 1].end = next;
            else
                segs[ns++] = (acc_seg){pos, next, mask};
        }
    }
    free(ev);
    g->acc = segs;
    g->nacc = ns;
}

static void finalize(npualloc_graph *g)
{
    g->lower_bound = lower_bound(g);
    chunks_covering(g->footprint, &g->mapped);
    size_t nout = 0;
    for (size_t i = 0; i < g->nallocs; i++)
        nout += g->allocs[i].free_node == NPUALLOC_GRAPH_NONE;
    range64 *outs = malloc((nout ? nout : 1) * sizeof *outs);
    size_t k = 0;
    g->output_bytes = 0;
    for (size_t i = 0; outs && i < g->nallocs; i++) {
        const galloc *x = &g->allocs[i];
        if (x->free_node == NPUALLOC_GRAPH_NONE) {
            outs[k++] = (range64){x->offset, x->offset + x->size};
            g->output_bytes += x->size;
        }
    }
    if (outs)
        qsort(outs, k, sizeof *outs, range_order);
    build_access_map(g);
    pthread_rwlock_wrlock(&reg_lock); /* runtime checks read these */
    g->outputs = outs;
    g->nout = k;
    pthread_rwlock_unlock(&reg_lock);
    free(g->active);
    g->active = NULL;
    g->nactive = g->capactive = 0;
}

/* ------------------------------------------------------------------------------------------
 * Executable graphs: physical memory per launch stream, launches
 * ------------------------------------------------------------------------------------------ */

static aclError physical_chunk(int32_t device, size_t size, aclrtDrvMemHandle *out)
{
    return vmm_physical_create(device, (vmm_kind_choice){{MEM_HUGE, MEM_NORMAL}, 2}, size, out);
}

/* bind_lock held. */
static arena *arena_get(npu_stream *s)
{
    uint64_t gen = npualloc_runtime_generation();
    for (arena *a = arenas; a; a = a->next)
        if (a->s == s && a->gen == gen)
            return a;
    arena *a = calloc(1, sizeof *a);
    if (!a)
        return NULL;
    stream_pin(s);
    a->s = s;
    a->gen = gen;
    a->device = stream_device(s);
    a->next = arenas;
    arenas = a;
    return a;
}

static aclError arena_grow(arena *a, size_t n)
{
    if (n <= a->n)
        return ACL_SUCCESS;
    if (!GROW(a->h, a->cap, n))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    while (a->n < n) {
        aclError rc = physical_chunk(a->device, chunk_size(a->n), &a->h[a->n]);
        if (rc != ACL_SUCCESS)
            return rc;
        a->n++;
    }
    return ACL_SUCCESS;
}

/* bind_lock held. */
static void arena_put(arena *a)
{
    if (--a->users > 0)
        return;
    for (arena **pp = &arenas; *pp; pp = &(*pp)->next) {
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    }
    if (a->gen == npualloc_runtime_generation())
        for (size_t i = 0; i < a->n; i++)
            (void)aclrtFreePhysical(a->h[i]);
    free(a->h);
    stream_release(a->s);
    free(a);
}

/* Unmaps an executable graph's memory (bind_lock held; its launches are over). */
static void exec_unbind(npualloc_graph_exec *e)
{
    npualloc_graph *g = e->g;
    bool live = e->gen == npualloc_runtime_generation();
    uint64_t off = 0;
    for (size_t i = 0; i < e->nchunks; i++) {
        if (live)
            (void)vmm_unmap_private((void *)(g->base + off));
        off += chunk_size(i);
        if (e->priv && e->priv[i]) {
            if (live)
                (void)aclrtFreePhysical(e->priv[i]);
            e->priv[i] = NULL;
        }
    }
    e->nchunks = 0;
    if (e->ar) {
        arena_put(e->ar);
        e->ar = NULL;
    }
    if (e->bound) {
        stream_release(e->bound);
        e->bound = NULL;
    }
}

/* Maps an executable graph's range onto stream s's pages (bind_lock held). */
static aclError exec_bind(npualloc_graph_exec *e, npu_stream *s)
{
    npualloc_graph *g = e->g;
    size_t n = chunks_covering(g->footprint, NULL);
    arena *a = arena_get(s);
    if (!a)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    a->users++;
    e->ar = a;
    stream_pin(s);
    e->bound = s;
    /* Shared chunks come from the arena; the arena grows to the largest graph bound to it. */
    size_t shared_needed = 0;
    for (size_t i = 0; i < n; i++)
        if (!e->is_priv[i])
            shared_needed = i + 1;
    aclError rc = arena_grow(a, shared_needed);
    uint64_t off = 0;
    for (size_t i = 0; i < n && rc == ACL_SUCCESS; i++) {
        aclrtDrvMemHandle h;
        if (e->is_priv[i]) {
            if ((rc = physical_chunk(g->device, chunk_size(i), &e->priv[i])) != ACL_SUCCESS)
                break;
            h = e->priv[i];
        } else {
            h = a->h[i];
        }
        if ((rc = vmm_map_private((void *)(g->base + off), chunk_size(i), h)) != ACL_SUCCESS) {
            if (e->is_priv[i]) {
                (void)aclrtFreePhysical(e->priv[i]);
                e->priv[i] = NULL;
            }
            break;
        }
        off += chunk_size(i);
        e->nchunks = i + 1;
    }
    if (rc != ACL_SUCCESS) {
        set_err(rc == ACL_ERROR_RT_MEMORY_ALLOCATION ? "launch: no device memory for the graph (%llu bytes mapped)"
                                                      : "launch: the graph's memory could not be mapped (%llu bytes "
                                                        "mapped; out of descriptors or mappings?)",
                (unsigned long long)g->mapped);
        exec_unbind(e);
    }
    return rc;
}

aclError npualloc_graph_instantiate(npualloc_graph *g, npualloc_graph_exec **out)
{
    if (!g || !out)
        return ACL_ERROR_INVALID_PARAM;
    if (graph_stale(g)) {
        set_err("the graph belongs to a runtime that was shut down");
        return ACL_ERROR_INVALID_PARAM;
    }
    npualloc_graph_exec *e = calloc(1, sizeof *e);
    if (!e)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_mutex_lock(&graph_lock);
    aclError rc = ACL_SUCCESS;
    pthread_mutex_lock(&viol_lock);
    bool violated = g->capture_violation;
    pthread_mutex_unlock(&viol_lock);
    if (g->state != G_CAPTURED) {
        set_err("instantiate: the graph %s", g->state == G_CAPTURING ? "is still being captured"
                                             : g->state == G_ENDING  ? "is still being captured (capture_end has "
                                                                       "not returned)"
                                             : g->state == G_EMPTY   ? "was never captured"
                                                                     : "is broken (its capture failed)");
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    } else if (g->exec) {
        set_err("instantiate: the graph already has an executable graph (one at a time: its addresses are fixed)");
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    } else if (violated) {
        set_err("instantiate: the checked graph recorded %zu violation(s) at capture", npualloc_graph_violation_count(g));
        rc = ACL_ERROR_RT_PARAM_INVALID;
    }
    if (rc == ACL_SUCCESS) {
        size_t nch = chunks_covering(g->footprint, NULL);
        e->run = malloc((g->nnodes ? g->nnodes : 1) * sizeof *e->run);
        e->priv = calloc(nch ? nch : 1, sizeof *e->priv);
        e->is_priv = calloc(nch ? nch : 1, sizeof *e->is_priv);
        if (!e->run || !e->priv || !e->is_priv)
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        for (size_t i = 0; rc == ACL_SUCCESS && i < g->nnodes; i++)
            if (g->nodes[i].kind != NPUALLOC_GRAPH_NODE_ALLOC && g->nodes[i].kind != NPUALLOC_GRAPH_NODE_FREE)
                e->run[e->nrun++] = (uint32_t)i;
        /* Chunks holding an output get pages of their own. */
        for (size_t k = 0; rc == ACL_SUCCESS && k < g->nout; k++) {
            uint64_t off = 0;
            for (size_t i = 0; i < nch; i++) {
                uint64_t end = off + chunk_size(i);
                if (g->outputs[k].start < end && off < g->outputs[k].end)
                    e->is_priv[i] = true;
                off = end;
            }
        }
    }
    if (rc == ACL_SUCCESS) {
        e->g = g;
        e->gen = g->gen;
        g->refs++;
        g->exec = e;
    }
    pthread_mutex_unlock(&graph_lock);
    if (rc != ACL_SUCCESS) {
        free(e->run);
        free(e->priv);
        free(e->is_priv);
        free(e);
        return rc;
    }
    *out = e;
    return ACL_SUCCESS;
}

npualloc_graph *npualloc_graph_exec_graph(npualloc_graph_exec *e) { return e ? e->g : NULL; }

/* A MEMCPY / MEMSET node at run time: validated again (memory may have gone since capture). */
static aclError run_mem_node(void *arg)
{
    const gnode *n = arg;
    int32_t dd = -1, sd = -1;
    vmm_read_lock();
    range_class dc = vmm_classify_locked(n->dst, n->count, &dd);
    range_class sc = n->src ? vmm_classify_locked(n->src, n->count, &sd) : RANGE_HOST;
    aclError rc = dc == RANGE_INVALID || sc == RANGE_INVALID ? ACL_ERROR_RT_PARAM_INVALID : ACL_SUCCESS;
    if (rc == ACL_SUCCESS && n->src && graph_ranges_active())
        rc = check_rules_locked(n->dst, dc, dd, n->src, sc, sd, n->count, (const npualloc_graph *)n->arg);
    else if (rc == ACL_SUCCESS && n->src && dc == RANGE_DEVICE && sc == RANGE_DEVICE && dd >= 0 && sd >= 0 &&
             !device_peer_enabled(dd, sd))
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (rc == ACL_SUCCESS) /* (a bad host address is an error here too: mem.h) */
        rc = n->src ? mem_move_locked(n->dst, dc, n->src, sc, n->count) : mem_set_locked(n->dst, dc, n->value, n->count);
    vmm_read_unlock();
    return rc == ACL_SUCCESS ? ACL_SUCCESS : ACL_ERROR_RT_DEVICE_MEM_ERROR;
}

aclError npualloc_graph_launch(npualloc_graph_exec *e, aclrtStream stream, int32_t device)
{
    if (!e)
        return ACL_ERROR_INVALID_PARAM;
    npualloc_graph *g = e->g;
    if (e->gen != npualloc_runtime_generation()) {
        set_err("launch: the graph belongs to a runtime that was shut down");
        return ACL_ERROR_INVALID_PARAM;
    }
    npu_stream *s;
    aclError rc = resolve_stream(stream, device, &s);
    if (rc != ACL_SUCCESS) {
        set_err("launch: not a live stream");
        return rc;
    }
    if (stream_device(s) != g->device) {
        stream_release(s);
        set_err("launch: the graph belongs to device %d, the stream to device %d", g->device, stream_device(s));
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    if (stream_capture_get(s)) {
        stream_release(s);
        set_err("launch: launching a graph on a capturing stream is not supported");
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    pthread_mutex_lock(&bind_lock);
    /* Launched on another stream before: its launches there finish before the range moves. */
    while (g->mapped && e->bound && e->bound != s) {
        npu_stream *old = e->bound;
        uint64_t pos = e->last_pos;
        if (!stream_passed(old, pos) && stream_waits_for_self(old)) {
            /* A task of that stream, with a launch queued behind it: the range cannot move while it runs
             * there, nor can this task wait for it. */
            pthread_mutex_unlock(&bind_lock);
            stream_release(s);
            set_err("launch: the graph's launch on another stream is queued behind this task of that stream; "
                    "launch it on that stream, or from elsewhere");
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        }
        stream_pin(old);
        pthread_mutex_unlock(&bind_lock);
        stream_wait_position(old, pos);
        pthread_mutex_lock(&bind_lock);
        if (e->bound == old && e->last_pos == pos)
            exec_unbind(e);
        stream_release(old);
    }
    if (g->mapped && !e->bound)
        rc = exec_bind(e, s);
    /* The launch's record comes first: nodes queued without one would outlive a destroy of the executable
     * (which waits for the recorded launches only), and a launch from a task of s cannot wait for them. */
    size_t k = 0;
    while (k < e->nlaunches && e->launches[k].s != s)
        k++;
    if (rc == ACL_SUCCESS && k == e->nlaunches && !GROW(e->launches, e->caplaunches, e->nlaunches + 1)) {
        set_err("launch: out of host memory for the launch's record");
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    /* All nodes queued at once, or none, and never into a capture that another thread began on s since the
     * check above (they would become its nodes, pointing into this graph). */
    stream_task_fn *fns = rc == ACL_SUCCESS ? malloc((e->nrun ? e->nrun : 1) * sizeof *fns) : NULL;
    void **args = fns ? malloc((e->nrun ? e->nrun : 1) * sizeof *args) : NULL;
    if (rc == ACL_SUCCESS && !args) {
        set_err("launch: out of host memory for the launch's tasks");
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    uint64_t pos = 0;
    if (rc == ACL_SUCCESS) {
        for (size_t i = 0; i < e->nrun; i++) {
            gnode *n = &g->nodes[e->run[i]];
            bool mem = n->kind == NPUALLOC_GRAPH_NODE_MEMCPY || n->kind == NPUALLOC_GRAPH_NODE_MEMSET;
            fns[i] = mem ? run_mem_node : n->fn;
            args[i] = mem ? (void *)n : n->arg;
        }
        rc = stream_enqueue_uncaptured(s, fns, args, e->nrun, &pos);
        if (rc == ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
            set_err("launch: launching a graph on a capturing stream is not supported");
    }
    free(fns);
    free(args);
    if (rc == ACL_SUCCESS) {
        if (e->bound == s)
            e->last_pos = pos;
        if (k < e->nlaunches) {
            e->launches[k].pos = pos;
        } else {
            stream_pin(s);
            e->launches[e->nlaunches++] = (struct launch_rec){s, pos};
        }
    }
    pthread_mutex_unlock(&bind_lock);
    stream_release(s);
    if (rc != ACL_SUCCESS && !last_err[0])
        set_err("launch: queueing the graph failed (%d)", rc);
    return rc;
}

static void graph_put(npualloc_graph *g);

/* Waits for every launch (the queued nodes point into the graph), then frees the executable. */
static void exec_destroy_now(npualloc_graph_exec *e)
{
    pthread_mutex_lock(&bind_lock);
    struct launch_rec *l = e->launches;
    size_t nl = e->nlaunches;
    e->launches = NULL;
    e->nlaunches = e->caplaunches = 0;
    pthread_mutex_unlock(&bind_lock);
    bool live = e->gen == npualloc_runtime_generation();
    for (size_t i = 0; i < nl; i++) {
        if (live)
            stream_wait_position(l[i].s, l[i].pos);
        stream_release(l[i].s);
    }
    free(l);
    pthread_mutex_lock(&bind_lock);
    exec_unbind(e);
    pthread_mutex_unlock(&bind_lock);
    npualloc_graph *g = e->g;
    pthread_mutex_lock(&graph_lock);
    g->exec = NULL;
    pthread_mutex_unlock(&graph_lock);
    free(e->run);
    free(e->priv);
    free(e->is_priv);
    free(e);
    graph_put(g);
}

static void *exec_destroy_thread(void *e)
{
    exec_destroy_now(e);
    return NULL;
}

static bool launches_pending(const npualloc_graph_exec *e)
{
    pthread_mutex_lock(&bind_lock);
    bool pending = false;
    for (size_t i = 0; i < e->nlaunches && !pending; i++)
        pending = !stream_passed(e->launches[i].s, e->launches[i].pos);
    pthread_mutex_unlock(&bind_lock);
    return pending && e->gen == npualloc_runtime_generation();
}

void npualloc_graph_exec_destroy(npualloc_graph_exec *e)
{
    if (!e)
        return;
    /* A stream's task cannot wait for launches queued behind it (on its own stream, or on one that waits
     * for it): a thread of its own waits and frees.  Without a thread the executable is kept, not freed
     * under its launches. */
    if (npualloc_in_stream_task() && launches_pending(e)) {
        pthread_attr_t attr;
        pthread_t t;
        if (pthread_attr_init(&attr) == 0) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            (void)pthread_create(&t, &attr, exec_destroy_thread, e);
            pthread_attr_destroy(&attr);
        }
        return;
    }
    exec_destroy_now(e);
}

/* ------------------------------------------------------------------------------------------
 * Destruction
 * ------------------------------------------------------------------------------------------ */

static void graph_free_all(npualloc_graph *g)
{
    bool live = !graph_stale(g);
    reg_remove(g); /* (a no-op when it was never registered, or purged as stale) */
    if (g->base && live)
        (void)vmm_release_private((void *)g->base);
    if (g->pool_ref && live)
        (void)npualloc_cache_pool_release(g->device, g->pool);
    for (size_t i = 0; i < g->nnodes; i++) {
        gnode *n = &g->nodes[i];
        if ((n->kind == NPUALLOC_GRAPH_NODE_TASK || n->kind == NPUALLOC_GRAPH_NODE_HOST ||
             n->kind == NPUALLOC_GRAPH_NODE_DELAY) &&
            n->cleanup)
            n->cleanup(n->arg);
    }
    for (size_t i = 0; i < g->nallocs; i++) {
        free(g->allocs[i].uses);
        free(g->allocs[i].rec);
    }
    for (size_t i = 0; i < g->nviol; i++)
        free(g->viol[i]);
    free(g->viol);
    free(g->nodes);
    free(g->deps);
    free(g->vcs);
    free(g->allocs);
    free(g->active);
    free(g->streams);
    free(g->events);
    free(g->acc);
    free(g->outputs);
    free(g);
}

static void graph_put(npualloc_graph *g)
{
    pthread_mutex_lock(&graph_lock);
    bool last = --g->refs == 0;
    pthread_mutex_unlock(&graph_lock);
    if (last)
        graph_free_all(g);
}

void npualloc_graph_destroy(npualloc_graph *g)
{
    if (!g)
        return;
    pthread_mutex_lock(&graph_lock);
    bool cap = g->state == G_CAPTURING && g->nstreams > 0;
    pthread_mutex_unlock(&graph_lock);
    if (cap)
        (void)npualloc_graph_capture_end(g); /* the streams leave capture mode */
    graph_put(g);
}

/* ------------------------------------------------------------------------------------------
 * Introspection
 * ------------------------------------------------------------------------------------------ */

aclError npualloc_graph_get_plan(npualloc_graph *g, npualloc_graph_plan *out)
{
    if (!g || !out)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&graph_lock);
    *out = (npualloc_graph_plan){.device = g->device,
                                 .base = g->base,
                                 .footprint = g->footprint,
                                 .lower_bound = g->lower_bound,
                                 .mapped = g->mapped,
                                 .output_bytes = g->output_bytes,
                                 .alloc_count = g->nallocs,
                                 .node_count = g->nnodes,
                                 .stream_count = g->nstreams,
                                 .checked = g->checked,
                                 .pool_mode = g->pool_mode,
                                 .instantiated = g->exec != NULL,
                                 .capture_mode = g->mode};
    bool done = g->state == G_CAPTURED;
    pthread_mutex_unlock(&graph_lock);
    if (!done) {
        set_err("the graph's plan is known once its capture ended");
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    }
    return ACL_SUCCESS;
}

size_t npualloc_graph_node_count(npualloc_graph *g)
{
    if (!g)
        return 0;
    pthread_mutex_lock(&graph_lock);
    size_t n = g->nnodes;
    pthread_mutex_unlock(&graph_lock);
    return n;
}

aclError npualloc_graph_get_node(npualloc_graph *g, size_t index, npualloc_graph_node *out)
{
    if (!g || !out)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&graph_lock);
    aclError rc = ACL_SUCCESS;
    if (index >= g->nnodes || g->state == G_CAPTURING) {
        rc = ACL_ERROR_INVALID_PARAM; /* (during capture the arrays may move) */
    } else {
        const gnode *n = &g->nodes[index];
        *out = (npualloc_graph_node){.kind = (npualloc_graph_node_kind)n->kind,
                                     .stream = n->stream,
                                     .deps = g->deps + n->dep_off,
                                     .dep_count = n->ndeps,
                                     .alloc = n->alloc,
                                     .dst = (uintptr_t)n->dst,
                                     .src = (uintptr_t)n->src,
                                     .count = n->count,
                                     .value = n->value};
    }
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

size_t npualloc_graph_alloc_count(npualloc_graph *g)
{
    if (!g)
        return 0;
    pthread_mutex_lock(&graph_lock);
    size_t n = g->nallocs;
    pthread_mutex_unlock(&graph_lock);
    return n;
}

aclError npualloc_graph_get_alloc(npualloc_graph *g, size_t index, npualloc_graph_alloc *out)
{
    if (!g || !out)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&graph_lock);
    aclError rc = ACL_SUCCESS;
    if (index >= g->nallocs) {
        rc = ACL_ERROR_INVALID_PARAM;
    } else {
        const galloc *x = &g->allocs[index];
        *out = (npualloc_graph_alloc){.address = g->base + x->offset,
                                      .offset = x->offset,
                                      .size = x->size,
                                      .requested = x->requested,
                                      .alloc_node = x->node,
                                      .free_node = x->free_node,
                                      .access_mask = x->access};
    }
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

aclError npualloc_graph_stream(npualloc_graph *g, size_t index, uint64_t *handle, int32_t *device)
{
    if (!g)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&graph_lock);
    aclError rc = index < g->nstreams ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
    if (rc == ACL_SUCCESS) {
        if (handle)
            *handle = g->streams[index].handle;
        if (device)
            *device = g->streams[index].device;
    }
    pthread_mutex_unlock(&graph_lock);
    return rc;
}

size_t npualloc_graph_violation_count(npualloc_graph *g)
{
    if (!g)
        return 0;
    pthread_mutex_lock(&viol_lock);
    size_t n = g->nviol;
    pthread_mutex_unlock(&viol_lock);
    return n;
}

bool npualloc_graph_violation(npualloc_graph *g, size_t index, char *buf, size_t len)
{
    if (!g)
        return false;
    pthread_mutex_lock(&viol_lock);
    bool ok = index < g->nviol;
    if (ok && buf && len)
        snprintf(buf, len, "%s", g->viol[index]);
    pthread_mutex_unlock(&viol_lock);
    return ok;
}

/* ------------------------------------------------------------------------------------------
 * Settings
 * ------------------------------------------------------------------------------------------ */

aclError npualloc_graph_set_mem_access(int32_t device, uint64_t mask)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(device) || (mask >> 1 >> (device_count() - 1)) != 0) {
        set_err("set_mem_access: device %d or mask %#llx names a device that does not exist", device,
                (unsigned long long)mask);
        return ACL_ERROR_RT_INVALID_DEVICEID;
    }
    pthread_mutex_lock(&access_lock);
    uint64_t gen = npualloc_runtime_generation();
    if (mem_access_gen != gen) {
        memset(mem_access, 0, sizeof mem_access);
        mem_access_gen = gen;
    }
    mem_access[device] = mask | ((uint64_t)1 << device);
    pthread_mutex_unlock(&access_lock);
    return ACL_SUCCESS;
}

aclError npualloc_graph_get_mem_access(int32_t device, uint64_t *mask)
{
    if (!mask)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(device))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    *mask = access_setting(device);
    return ACL_SUCCESS;
}

/* ------------------------------------------------------------------------------------------
 * fork
 * ------------------------------------------------------------------------------------------ */

/* runtime.c calls these in the order of graph.h: the outer locks before every runtime lock, the
 * leaves after them all. */
void graph_atfork_prepare_outer(void)
{
    pthread_mutex_lock(&bind_lock);
    pthread_mutex_lock(&graph_lock);
}

void graph_atfork_prepare_leaves(void)
{
    pthread_rwlock_wrlock(&reg_lock);
    pthread_mutex_lock(&viol_lock);
    pthread_mutex_lock(&access_lock);
}

static void release_fork_mutexes(void)
{
    pthread_mutex_unlock(&access_lock);
    pthread_mutex_unlock(&viol_lock);
    pthread_mutex_unlock(&graph_lock);
    pthread_mutex_unlock(&bind_lock);
}

void graph_atfork_parent(void)
{
    pthread_rwlock_unlock(&reg_lock);
    release_fork_mutexes();
}

/* The child has no device memory and no streams of the parent: every graph is stale (the runtime
 * generation changed) and the module starts over (what the parent's threads held is leaked). */
void graph_atfork_child(void)
{
    release_fork_mutexes(); /* the forking thread took them in prepare, so it may release them here */
    rwlock_reset_in_child(&reg_lock);
    /* a parent's capture_end may have been waiting on it: its waiter state means nothing here */
    join_cv = (pthread_cond_t)PTHREAD_COND_INITIALIZER;
    for (npualloc_graph *c = capturing; c; c = c->cap_next)
        c->joining = 0; /* a join the fork cut short never ends here */
    capturing = NULL;
    arenas = NULL;
    reg = NULL;
    nreg = capreg = 0;
    atomic_store(&graph_capturing_streams, 0);
    atomic_store(&graph_live_ranges, 0);
}
