/*
 * ipc.c - cross-process sharing of device memory (see ipc.h for the design, the wire format
 * and the error codes).
 *
 * Sections: helpers; the export table (exporter side); the server thread; the importing side
 * (connections, the import table); the aclrt* functions; IPC keys; caching-allocator shares;
 * lifetime (fork, shutdown).
 */
#include "ipc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "caching.h"
#include "common.h"
#include "device.h"
#include "host.h"
#include "va_space.h"
#include "vmm.h"

#define MAX_PIDS_PER_EXPORT 65536
#define MAX_CLIENTS 4096
#define MAX_FOREIGN_CLIENTS 64 /* connections of users not accepted (they only get refusals) */
#define MAX_CLIENT_FAILURES 16
#define RATE_SLOTS 64             /* peer processes whose failed lookups are counted */
#define RATE_FAILURES_PER_S 1000  /* answered failed lookups per peer process and second */
#define KNOWN_SERVERS 8           /* servers that answered this process (tried first) */
#define MAX_SHARE_PAGES (1u << 20)
#define SEALS (F_SEAL_SHRINK | F_SEAL_GROW)

/* ---- state ---- */

/* Who a process is (see proc_identity): the pidfs inode number of its pidfd, exact, where
 * the kernel has pidfs; else its start time in clock ticks since boot, which two processes
 * that get one pid within one tick share. */
typedef struct proc_id {
    uint64_t ino;   /* 0: unknown */
    uint64_t start; /* 0: unknown */
} proc_id;

typedef struct pid_grant {
    int32_t pid;
    proc_id who; /* the process that had the pid when it was granted (all 0: none had it) */
} pid_grant;

/* Something this process exports: a shareable-handle value or an IPC key. */
typedef struct export_entry {
    struct export_entry *next;
    bool is_key;
    uint64_t value;    /* values */
    uint8_t token[16]; /* keys */
    char key[IPC_KEY_LEN];
    vmm_share_ref ref;
    vmm_share_info info;
    uint64_t flags;      /* ..._DISABLE_PID_VALIDATION */
    bool user;           /* exported through the API (one export per handle) */
    bool gone;           /* the owner freed the memory (kept while share records list it) */
    uint32_t share_refs; /* share records listing it */
    pid_grant *pids;
    size_t pid_count, pid_cap;
} export_entry;

/* A handle this process imported (one per exported memory and device). */
typedef struct import_entry {
    struct import_entry *next;
    bool is_key;
    uint64_t value;
    uint8_t token[16];
    int32_t exporter; /* keys: the exporter's pid (tokens are the exporter's) */
    int32_t device;   /* the device it was imported for */
    uint64_t handle_id, serial;
    size_t size;
    bool pending; /* a thread is importing it: others wait */
} import_entry;

/* An IPC key mapped by aclrtIpcMemImportByKey. */
typedef struct key_import {
    struct key_import *next;
    char key[IPC_KEY_LEN];
    int32_t device;
    void *ptr;
    uint64_t handle_id;
    uint32_t refs;
} key_import;

/* A connection to an exporter kept while blocks of it are open here. */
typedef struct session {
    struct session *next;
    int32_t pid;
    uint32_t secret;
    int fd;
    uint32_t refs;
    pthread_mutex_t lock; /* one request at a time; the fields below are under it */
    uint32_t next_id;     /* of the next request (never 0) */
    uint32_t last_reply;  /* id of the last reply read: late ones come between it and ours */
    uint32_t cancel_of;   /* an OPEN that timed out and whose CANCEL is not sent yet (0: none) */
    /* The owner hung up or broke the protocol (never a mere timeout: see "Request ids" in
     * ipc.h): nothing more is sent on it and new opens connect anew.  Written under both
     * locks, read under either. */
    bool dead;
} session;

/* A caching-allocator block shared by npualloc.share (owner side). */
typedef struct share_record {
    struct share_record *next;
    uint8_t token[16];
    int32_t device;
    cache_block *block;
    bool alive; /* the owner has not freed the block */
    uint32_t pins;
    char kind;  /* 'c': plain segment, 'e': expandable pages */
    uint64_t offset, size, page_size;
    size_t count;
    export_entry **entries;
} share_record;

/* A block opened by npualloc.open_shared (importer side). */
typedef struct open_share {
    struct open_share *next;
    uint8_t token[16];
    int32_t exporter;
    int32_t device;
    session *s;
    void *base; /* the reserved range */
    void *ptr;  /* base + offset */
    size_t count, page_size;
    uint64_t *handles;
    uint32_t refs;
} open_share;

/* A connection accepted by the server (server thread only). */
typedef struct client_pin {
    share_record *rec;
    uint32_t n;
} client_pin;

typedef struct client {
    int fd;
    /* The last request, for a CANCEL that follows it (see "Request ids" in ipc.h): its id, and
     * the share it pinned when it was an OPEN that did. */
    uint32_t last_id;
    bool last_pinned;
    uint8_t last_token[16];
    int32_t pid;   /* SO_PEERCRED: the kernel's word, fixed at connect time */
    uint32_t uid;
    proc_id who;   /* read at accept (all 0: unknown, no whitelist admits it) */
    bool uid_ok;
    uint32_t failures;
    bool answered;     /* a lookup of this connection found a live value: not a blind guesser */
    client_pin *pins;
    size_t pin_count, pin_cap;
} client;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t cond; /* a pending import finished */
    int32_t pid;
    bool server_running;
    uint32_t secret;
    int listen_fd, wake_fd;
    pthread_t thread;
    export_entry *exports;
    import_entry *imports;
    key_import *key_imports;
    session *sessions;
    share_record *shares;
    open_share *opens;
    _Atomic size_t client_count, pin_count;
} ipc = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER, .listen_fd = -1, .wake_fd = -1};

/* Server-thread state (and ipc_shutdown's, after the thread is joined). */
static client *clients;
static size_t nclients, clients_cap;
/* A descriptor (/dev/null) the server keeps in reserve.  When the process has no free
 * descriptor, accept() fails and the connection stays queued: the listener would poll ready for
 * ever.  Closing the spare makes room to accept the connection, answer it 507022 and close it
 * (the importer learns at once), then the spare is taken back.  Opened with the server; the
 * server thread alone changes it (atomic for the fork handler, which closes the child's copy). */
static _Atomic int spare_fd = -1;
#define LISTEN_REST_NS 100000000u /* no spare either: the listener rests 100 ms, then retries */

/* Failed lookups per peer process in the current one-second window (server thread only). */
typedef struct rate_slot {
    int32_t pid;
    uint64_t window_start; /* ns */
    uint32_t failures;
} rate_slot;
static rate_slot rates[RATE_SLOTS];
static _Atomic uint64_t lookups_failed, lookups_refused;

/* A server this process asked for a value (importer side). */
typedef struct server_id {
    int32_t pid;
    uint32_t secret;
} server_id;
static server_id known[KNOWN_SERVERS]; /* answered before, most recent first (ipc.lock) */
static size_t nknown;

/* ---- helpers ---- */

static int32_t self_pid(void)
{
    if (!ipc.pid)
        ipc.pid = (int32_t)getpid();
    return ipc.pid;
}

static void random_bytes(void *buf, size_t n)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t got = getrandom(p, n, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            /* no getrandom: the clock is a poor substitute, but never fails */
            uint64_t t = host_now_ns() ^ ((uint64_t)getpid() << 32);
            got = (ssize_t)(n < sizeof t ? n : sizeof t);
            memcpy(p, &t, (size_t)got);
        }
        p += got;
        n -= (size_t)got;
    }
}

static uint64_t clock_ticks(void)
{
    static long hz;
    if (!hz)
        hz = sysconf(_SC_CLK_TCK);
    return hz > 0 ? (uint64_t)hz : 100;
}

/* A process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or 0. */
static uint64_t proc_start(int32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may contain spaces and parentheses */
    if (!p)
        return 0;
    p++; /* at the space before field 3 */
    for (int field = 3; field < 22 && p; field++) /* then before field `field + 1` */
        p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* Linux 6.5; older C library headers lack it.  77 in the generic numbering of x86 and arm64
 * (some architectures number socket options otherwise: they rely on their headers). */
#if !defined(SO_PEERPIDFD) && (defined(__x86_64__) || defined(__aarch64__))
#define SO_PEERPIDFD 77
#endif
#define PIDFS_MAGIC 0x50494446 /* "PIDF": the pidfs file system, Linux 6.9 */

/* The inode number of a pidfd, which pidfs (Linux 6.9) makes unique to one process for the
 * life of the system on 64-bit kernels; 0 on other kernels (their pidfds share one inode).
 * Closes the pidfd. */
static uint64_t pidfd_ino(int pidfd)
{
    struct statfs fs;
    struct stat st;
    uint64_t ino = 0;
    if (sizeof(void *) >= 8 && fstatfs(pidfd, &fs) == 0 && fs.f_type == PIDFS_MAGIC && fstat(pidfd, &st) == 0)
        ino = (uint64_t)st.st_ino;
    close(pidfd);
    return ino;
}

/* The process that has `pid` now: its pidfs inode (0 where there is no pidfs) and start time.
 * False when no process has it: pidfd_open says so (ESRCH; EINVAL for a thread that leads no
 * process).  Where pidfd_open is missing or fails otherwise (no descriptor free), the start
 * time alone tells. */
static bool proc_identity(int32_t pid, proc_id *out)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0u);
    if (fd < 0 && (errno == ESRCH || errno == EINVAL))
        return false;
    out->ino = fd >= 0 ? pidfd_ino(fd) : 0;
    out->start = proc_start(pid);
    return true;
}

/* The process at the other end of an accepted connection, as the kernel recorded it at connect
 * time (SO_PEERPIDFD, Linux 6.5; the pid of SO_PEERCRED could name a newer process by now). */
static proc_id peer_identity(int sock, int32_t pid)
{
    proc_id who = {0, 0};
#ifdef SO_PEERPIDFD
    int pidfd = -1;
    socklen_t len = sizeof pidfd;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && len == sizeof pidfd && pidfd >= 0)
        who.ino = pidfd_ino(pidfd);
#else
    (void)sock;
#endif
    /* now, while the connecting process most likely lives: read later, its pid could name a
     * newer process by then */
    who.start = proc_start(pid);
    return who;
}

/* Is the process `c` the one a grant names?  With pidfs inodes on both sides, exactly; else by
 * start time (CANN's time check), which cannot tell apart two processes that got the pid within
 * one clock tick (10 ms). */
static bool same_process(const proc_id *granted, const proc_id *c)
{
    if (granted->ino)
        return granted->ino == c->ino;
    return c->start != 0 && c->start <= granted->start;
}

static uint64_t boot_ticks_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return (uint64_t)ts.tv_sec * clock_ticks() + (uint64_t)ts.tv_nsec * clock_ticks() / 1000000000u;
}

/* The users whose processes may import from this one, and this one from theirs. */
static bool uid_allowed(uint32_t uid)
{
    if (uid == (uint32_t)geteuid())
        return true;
    const char *list = getenv("NPUALLOC_IPC_ALLOW_UIDS");
    while (list && *list) {
        char *end;
        unsigned long v = strtoul(list, &end, 10);
        if (end != list && v == uid)
            return true;
        list = *end ? end + 1 : end;
    }
    return false;
}

#define DEFAULT_TIMEOUT_MS 10000
#define MAX_TIMEOUT_MS 3600000 /* an hour */

/* NPUALLOC_IPC_TIMEOUT_MS: a whole number of milliseconds from 1 to MAX_TIMEOUT_MS. */
bool ipc_check_env(char *err, size_t errlen)
{
    long ms;
    if (env_whole_number("NPUALLOC_IPC_TIMEOUT_MS", 1, MAX_TIMEOUT_MS, &ms) >= 0)
        return true;
    snprintf(err, errlen, "NPUALLOC_IPC_TIMEOUT_MS='%s' is not a timeout: use a whole number of milliseconds from 1 to %d",
             getenv("NPUALLOC_IPC_TIMEOUT_MS"), MAX_TIMEOUT_MS);
    return false;
}

static int timeout_ms(void)
{
    long ms;
    return env_whole_number("NPUALLOC_IPC_TIMEOUT_MS", 1, MAX_TIMEOUT_MS, &ms) > 0 ? (int)ms : DEFAULT_TIMEOUT_MS;
}

int ipc_server_name(int32_t pid, uint32_t secret, char *buf, size_t len)
{
    return snprintf(buf, len, "npualloc-ipc-%d-%03x", (int)pid, (unsigned)secret);
}

static socklen_t make_addr(int32_t pid, uint32_t secret, struct sockaddr_un *a)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = ipc_server_name(pid, secret, a->sun_path + 1, sizeof a->sun_path - 1);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* A value: 56 random bits around the device's 8. */
static uint64_t make_value(int32_t device)
{
    uint64_t r = 0;
    random_bytes(&r, sizeof r);
    return (r & ~IPC_VALUE_DEVICE_MASK) | ((uint64_t)(uint8_t)device << IPC_VALUE_DEVICE_SHIFT);
}

/* Token comparison whose time does not depend on where the tokens differ. */
static bool same_token(const uint8_t a[16], const uint8_t b[16])
{
    uint8_t diff = 0;
    for (int i = 0; i < 16; i++)
        diff |= (uint8_t)(a[i] ^ b[i]);
    return diff == 0;
}

static void hex16(const uint8_t t[16], char out[33])
{
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", t[i]);
}

static bool unhex16(const char *s, uint8_t t[16])
{
    for (int i = 0; i < 16; i++) {
        unsigned v = 0;
        for (int j = 0; j < 2; j++) {
            char c = s[2 * i + j];
            v <<= 4;
            if (c >= '0' && c <= '9')
                v |= (unsigned)(c - '0');
            else if (c >= 'a' && c <= 'f')
                v |= (unsigned)(c - 'a' + 10);
            else
                return false;
        }
        t[i] = (uint8_t)v;
    }
    return true;
}

static void make_key(int32_t pid, uint32_t secret, int32_t device, const uint8_t token[16], char key[IPC_KEY_LEN])
{
    char hex[33];
    hex16(token, hex);
    snprintf(key, IPC_KEY_LEN, "npualloc-k1-%d-%03x-%d-%s", (int)pid, (unsigned)secret, (int)device, hex);
}

/* Parses a key strictly; false for anything not made by make_key. */
static bool parse_key(const char *key, int32_t *pid, uint32_t *secret, int32_t *device, uint8_t token[16])
{
    if (strnlen(key, IPC_KEY_LEN) >= IPC_KEY_LEN || strncmp(key, "npualloc-k1-", 12) != 0)
        return false;
    const char *p = key + 12;
    char *end;
    errno = 0;
    long v = strtol(p, &end, 10);
    if (end == p || *end != '-' || v <= 0 || v >= (1L << IPC_PID_BITS) || errno)
        return false;
    *pid = (int32_t)v;
    p = end + 1;
    unsigned long s = strtoul(p, &end, 16);
    if (end != p + 3 || *end != '-' || s >= (1u << IPC_SECRET_BITS))
        return false;
    *secret = (uint32_t)s;
    p = end + 1;
    long d = strtol(p, &end, 10);
    if (end == p || *end != '-' || d < 0 || d > 255)
        return false;
    *device = (int32_t)d;
    p = end + 1;
    if (strlen(p) != 32 || !unhex16(p, token))
        return false;
    char again[IPC_KEY_LEN]; /* canonical form only (no leading zeros, signs or spaces) */
    make_key(*pid, *secret, *device, token, again);
    return strcmp(again, key) == 0;
}

/* ---- the export table (ipc.lock held) ---- */

static export_entry *export_by_serial(uint64_t serial)
{
    for (export_entry *e = ipc.exports; e; e = e->next)
        if (e->ref.serial == serial && !e->gone)
            return e;
    return NULL;
}

static export_entry *export_by_value(uint64_t value)
{
    for (export_entry *e = ipc.exports; e; e = e->next)
        if (!e->is_key && e->value == value)
            return e;
    return NULL;
}

static export_entry *export_by_token(const uint8_t token[16], int32_t device)
{
    for (export_entry *e = ipc.exports; e; e = e->next)
        if (e->is_key && same_token(e->token, token) && e->info.device == device)
            return e;
    return NULL;
}

static void export_remove(export_entry *e)
{
    for (export_entry **link = &ipc.exports; *link; link = &(*link)->next) {
        if (*link == e) {
            *link = e->next;
            break;
        }
    }
    free(e->pids);
    free(e);
}

/* Releases an export no longer wanted by its user or its last share record. */
static void export_maybe_remove(export_entry *e)
{
    if (e->share_refs == 0 && (!e->user || e->gone))
        export_remove(e);
}

/* Starts the server if needed (ipc.lock held). */
static aclError ensure_server_locked(void);

/* Creates the export of a referenced handle or allocation (ipc.lock held). */
static aclError export_create(const vmm_share_ref *ref, const vmm_share_info *info, bool is_key, bool user,
                              uint64_t flags, export_entry **out)
{
    /* Memory created past the descriptor budget is served through a reopen that needs
     * capabilities: an export that could never be served fails here, not at the import. */
    aclError rc = vmm_share_check_reopen(ref);
    if (rc == ACL_SUCCESS)
        rc = ensure_server_locked();
    if (rc != ACL_SUCCESS)
        return rc;
    export_entry *e = calloc(1, sizeof *e);
    if (!e)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    e->is_key = is_key;
    e->ref = *ref;
    e->info = *info;
    e->flags = flags;
    e->user = user;
    if (is_key) {
        do
            random_bytes(e->token, sizeof e->token);
        while (export_by_token(e->token, info->device));
        make_key(self_pid(), ipc.secret, info->device, e->token, e->key);
    } else {
        do
            e->value = make_value(info->device);
        while ((e->value & ~IPC_VALUE_DEVICE_MASK) == 0 || export_by_value(e->value));
    }
    e->next = ipc.exports;
    ipc.exports = e;
    /* The owner may have freed it while we were not holding the lock: the release hook
     * either already ran (then drop it here) or waits for the lock (then it drops it). */
    if (!vmm_share_ref_live(ref)) {
        export_remove(e);
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    *out = e;
    return ACL_SUCCESS;
}

static bool whitelisted(const export_entry *e, const client *c)
{
    for (size_t i = 0; i < e->pid_count; i++)
        if (e->pids[i].pid == c->pid && same_process(&e->pids[i].who, &c->who))
            return true;
    return false;
}

static aclError add_pids(export_entry *e, const int32_t *pids, size_t n)
{
    if (n > MAX_PIDS_PER_EXPORT - e->pid_count) /* not pid_count + n, which a huge n wraps */
        return ACL_ERROR_RT_PARAM_INVALID;
    if (!ARRAY_RESERVE(e->pids, e->pid_cap, e->pid_count + n, 8))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    uint64_t now = boot_ticks_now();
    for (size_t i = 0; i < n; i++) {
        /* The process that has the pid now.  A pid nobody has admits nobody (CANN's time
         * check: the pid must be set after the importer started); without pidfd_open, it
         * admits no process started later. */
        proc_id who = {0, 0};
        if (proc_identity(pids[i], &who) && !who.ino && !who.start)
            who.start = now;
        bool seen = false;
        for (size_t j = 0; j < e->pid_count && !seen; j++) {
            if (e->pids[j].pid == pids[i]) {
                e->pids[j].who = who;
                seen = true;
            }
        }
        if (!seen)
            e->pids[e->pid_count++] = (pid_grant){pids[i], who};
    }
    return ACL_SUCCESS;
}

/* ---- release hooks ---- */

/* vmm: the user freed exported or imported memory (no vmm lock held). */
static void on_released(uint64_t serial)
{
    pthread_mutex_lock(&ipc.lock);
    for (export_entry *e = ipc.exports, *next; e; e = next) {
        next = e->next;
        if (e->ref.serial == serial) {
            e->gone = true;
            e->user = false;
            export_maybe_remove(e);
        }
    }
    for (import_entry **link = &ipc.imports; *link;) {
        import_entry *i = *link;
        if (i->serial == serial && !i->pending) {
            *link = i->next;
            free(i);
        } else {
            link = &i->next;
        }
    }
    pthread_mutex_unlock(&ipc.lock);
}

static void share_delete(share_record *rec);

/* caching: the owner frees a shared block (the device lock is held). */
static void on_block_freed(device_cache *dc, cache_block *b)
{
    (void)dc;
    pthread_mutex_lock(&ipc.lock);
    for (share_record *rec = ipc.shares; rec; rec = rec->next) {
        if (rec->block == b && rec->alive) {
            rec->alive = false; /* no new opens */
            if (rec->pins == 0)
                share_delete(rec);
            break;
        }
    }
    pthread_mutex_unlock(&ipc.lock);
}

__attribute__((constructor)) static void install_hooks(void)
{
    vmm_share_released = on_released;
    cache_share_freed = on_block_freed;
}

/* ---- the server (exporter side) ---- */

static share_record *share_by_token(const uint8_t token[16])
{
    for (share_record *r = ipc.shares; r; r = r->next)
        if (same_token(r->token, token))
            return r;
    return NULL;
}

/* Does the client hold a pin on a share that lists the export? (ipc.lock held) */
static bool client_pins_entry(const client *c, const export_entry *e)
{
    for (size_t i = 0; i < c->pin_count; i++) {
        const share_record *rec = c->pins[i].rec;
        for (size_t j = 0; j < rec->count; j++)
            if (rec->entries[j] == e)
                return true;
    }
    return false;
}

/* A user's live export of a value (ipc.lock held). */
static bool value_exported(uint64_t value)
{
    const export_entry *e = export_by_value(value);
    return e && e->user && !e->gone;
}

static aclError serve_import(client *c, const ipc_request *rq, ipc_reply *rp, int *fd)
{
    pthread_mutex_lock(&ipc.lock);
    export_entry *e = rq->op == IPC_OP_IMPORT ? export_by_value(rq->value)
                                              : export_by_token(rq->token, (int32_t)rq->value);
    aclError rc = ACL_SUCCESS;
    vmm_share_ref ref;
    /* Not ours: 107017 to anybody (importers search the servers; see ipc.h).  Ours, to a
     * user we do not accept: 507899 (they had to know the value to learn that much). */
    if (!e || e->gone)
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    else if (!c->uid_ok)
        rc = ACL_ERROR_RT_DRV_INTERNAL_ERROR;
    else if (!client_pins_entry(c, e) &&
             !(e->user && ((e->flags & ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION) || whitelisted(e, c))))
        rc = ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* "Current process not add in pid list" */
    else
        ref = e->ref;
    pthread_mutex_unlock(&ipc.lock);
    if (rc != ACL_SUCCESS)
        return rc;
    vmm_share_info info;
    rc = vmm_share_dup_fd(&ref, fd, &info); /* fails once the owner freed it */
    if (rc != ACL_SUCCESS)
        return rc;
    if (fcntl(*fd, F_ADD_SEALS, SEALS) != 0) {
        close(*fd);
        *fd = -1;
        return ACL_ERROR_RT_IPC_ERROR;
    }
    rp->device = info.device;
    rp->kind = (uint32_t)info.kind;
    rp->size = info.size;
    return ACL_SUCCESS;
}

static aclError serve_open(client *c, const uint8_t token[16])
{
    if (!c->uid_ok)
        return ACL_ERROR_RT_DRV_INTERNAL_ERROR;
    pthread_mutex_lock(&ipc.lock);
    share_record *rec = share_by_token(token);
    int32_t dev = rec && rec->alive ? rec->device : -1;
    pthread_mutex_unlock(&ipc.lock);
    device_cache *dc = dev >= 0 ? cache_device(dev) : NULL;
    if (!dc)
        return ACL_ERROR_RT_INVALID_HANDLE;
    pthread_mutex_lock(&ipc.lock); /* the pins array is fork-consistent (serve_close) */
    bool room = ARRAY_RESERVE(c->pins, c->pin_cap, c->pin_count + 1, 4);
    pthread_mutex_unlock(&ipc.lock);
    if (!room)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    aclError rc = ACL_SUCCESS;
    cache_lock_acquire(&dc->lock); /* lock order: device cache, then ipc */
    pthread_mutex_lock(&ipc.lock);
    rec = share_by_token(token);
    if (!rec || !rec->alive) {
        rc = ACL_ERROR_RT_INVALID_HANDLE; /* the owner freed the block meanwhile */
    } else {
        size_t i = 0;
        while (i < c->pin_count && c->pins[i].rec != rec)
            i++;
        if (i == c->pin_count)
            c->pins[c->pin_count++] = (client_pin){rec, 0};
        c->pins[i].n++;
        rec->pins++;
        rec->block->share_pins++;
        atomic_fetch_add(&ipc.pin_count, 1);
    }
    pthread_mutex_unlock(&ipc.lock);
    cache_lock_release(&dc->lock);
    return rc;
}

/* Drops n pins of a share (no lock held). */
static void unpin(share_record *rec, uint32_t n)
{
    device_cache *dc = cache_device(rec->device);
    if (dc)
        cache_lock_acquire(&dc->lock);
    pthread_mutex_lock(&ipc.lock);
    for (uint32_t i = 0; i < n; i++) {
        if (dc)
            cache_share_unpin_locked(dc, rec->block); /* the last one completes a pending free */
        rec->pins--;
        atomic_fetch_sub(&ipc.pin_count, 1);
    }
    if (!rec->alive && rec->pins == 0)
        share_delete(rec);
    pthread_mutex_unlock(&ipc.lock);
    if (dc)
        cache_lock_release(&dc->lock);
}

/* The server thread alone uses the client table and each client's pins, but it changes them under
 * ipc.lock, which fork's prepare handler takes: the child then finds them whole, not half changed
 * (it closes the descriptors and frees the arrays; a free already done, or a pointer realloc had
 * moved, was freed twice). */

static aclError serve_close(client *c, const uint8_t token[16])
{
    for (size_t i = 0; i < c->pin_count; i++) {
        if (memcmp(c->pins[i].rec->token, token, 16) == 0) {
            share_record *rec = c->pins[i].rec;
            pthread_mutex_lock(&ipc.lock);
            if (--c->pins[i].n == 0)
                c->pins[i] = c->pins[--c->pin_count];
            pthread_mutex_unlock(&ipc.lock);
            unpin(rec, 1);
            return ACL_SUCCESS;
        }
    }
    return ACL_ERROR_RT_INVALID_HANDLE;
}

static void client_drop(size_t index)
{
    pthread_mutex_lock(&ipc.lock);
    client gone = clients[index];
    close(gone.fd); /* first: the peer sees the hang-up at once */
    clients[index] = clients[--nclients];
    atomic_store(&ipc.client_count, nclients);
    pthread_mutex_unlock(&ipc.lock);
    for (size_t i = 0; i < gone.pin_count; i++)
        unpin(gone.pins[i].rec, gone.pins[i].n);
    free(gone.pins);
}

static bool send_reply(int sock, const ipc_reply *rp, int fd)
{
    struct iovec iov = {(void *)rp, sizeof *rp};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        memset(&u, 0, sizeof u);
        msg.msg_control = u.buf;
        msg.msg_controllen = sizeof u.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    }
    return sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof *rp;
}

static aclError serve_probe(uint64_t value)
{
    pthread_mutex_lock(&ipc.lock);
    bool live = value_exported(value);
    pthread_mutex_unlock(&ipc.lock);
    return live ? ACL_SUCCESS : ACL_ERROR_RT_INVALID_HANDLE;
}

/* The failed-lookup count of a peer process in its current second.  A peer not in the table
 * takes a free slot, one whose second is over, or else the one whose second began first. */
static rate_slot *rate_of(int32_t pid)
{
    uint64_t now = host_now_ns();
    rate_slot *r = NULL, *spare = NULL, *oldest = &rates[0];
    for (size_t i = 0; i < RATE_SLOTS && !r; i++) {
        rate_slot *s = &rates[i];
        bool over = now - s->window_start >= 1000000000u;
        if (s->pid == pid)
            r = s;
        else if (!spare && (s->pid == 0 || over))
            spare = s;
        else if (s->window_start < oldest->window_start)
            oldest = s;
    }
    if (!r) {
        r = spare ? spare : oldest;
        *r = (rate_slot){pid, now, 0};
    } else if (now - r->window_start >= 1000000000u) {
        r->window_start = now;
        r->failures = 0;
    }
    return r;
}

/* The answer to a request refused unread (id 0, status 507022). */
static ipc_reply refusal(void)
{
    return (ipc_reply){.magic = IPC_MAGIC, .version = IPC_VERSION, .status = ACL_ERROR_RT_IPC_ERROR, .device = -1};
}

/* A request of another protocol version is answered 507022, in the layout of version 1 to a
 * version-1 sender (the only one it can read), so that it fails with an IPC error rather than
 * take the hang-up that follows for an exporter that went away. */
static void refuse_version(int sock, uint16_t version)
{
    struct {
        uint32_t magic;
        int32_t status, device;
        uint32_t kind;
        uint64_t size;
    } v1 = {IPC_MAGIC, ACL_ERROR_RT_IPC_ERROR, -1, 0, 0};
    _Static_assert(sizeof v1 == IPC_V1_REPLY_SIZE, "version 1's reply");
    ipc_reply rp = refusal();
    if (version == 1)
        (void)send(sock, &v1, sizeof v1, MSG_DONTWAIT | MSG_NOSIGNAL);
    else
        (void)send_reply(sock, &rp, -1);
}

/* CANCEL: undoes the pin of the OPEN it names if that OPEN was the connection's last request
 * and pinned (see "Request ids" in ipc.h). */
static void serve_cancel(client *c, uint64_t id)
{
    if (c->last_pinned && c->last_id == id)
        (void)serve_close(c, c->last_token);
}

/* Handles one message of a client; false when the client is to be dropped. */
static bool serve_client(size_t index)
{
    client *c = &clients[index];
    ipc_request rq;
    ssize_t n = recv(c->fd, &rq, sizeof rq, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return true;
    /* magic and version open every version's request (ipc.h, Versions) */
    if (n >= 8 && rq.magic == IPC_MAGIC && rq.version != IPC_VERSION) {
        refuse_version(c->fd, rq.version);
        return false;
    }
    if (n != (ssize_t)sizeof rq || rq.magic != IPC_MAGIC)
        return false; /* hang-up, error, or not our protocol */
    /* rq.claimed_pid is deliberately not read: who the client is comes from SO_PEERCRED. */
    if (rq.op < IPC_OP_IMPORT || rq.op > IPC_OP_CANCEL)
        return false;
    if (rq.op == IPC_OP_CANCEL) { /* not a lookup, and unanswered */
        serve_cancel(c, rq.value);
        c->last_pinned = false;
        return true;
    }
    c->last_pinned = false;
    c->last_id = rq.id;
    ipc_reply rp = {.magic = IPC_MAGIC, .version = IPC_VERSION, .op = rq.op, .id = rq.id, .device = -1};
    int fd = -1;
    /* Lookups of a peer over its budget are refused unanswered; the thread never waits. */
    rate_slot *rate = rq.op != IPC_OP_CLOSE ? rate_of(c->pid) : NULL;
    if (rate && rate->failures >= RATE_FAILURES_PER_S) {
        rp.status = ACL_ERROR_RT_IPC_ERROR;
        atomic_fetch_add(&lookups_refused, 1);
        c->failures++;
    } else {
        switch (rq.op) {
        case IPC_OP_IMPORT:
        case IPC_OP_IMPORT_KEY:
            rp.status = serve_import(c, &rq, &rp, &fd);
            break;
        case IPC_OP_OPEN:
            rp.status = serve_open(c, rq.token);
            if (rp.status == ACL_SUCCESS) {
                c->last_pinned = true;
                memcpy(c->last_token, rq.token, 16);
            }
            break;
        case IPC_OP_CLOSE:
            rp.status = serve_close(c, rq.token);
            break;
        default:
            rp.status = serve_probe(rq.value);
            break;
        }
        if (rate && rp.status != ACL_SUCCESS) {
            rate->failures++;
            atomic_fetch_add(&lookups_failed, 1);
            c->failures++;
        }
        c->answered |= rp.status == ACL_SUCCESS;
    }
    bool ok = send_reply(c->fd, &rp, fd);
    if (fd >= 0)
        close(fd);
    /* A guesser goes.  A connection holding pins stays (dropping it would release them), and so does one
     * that found a live value: its process's threads share it, and one opening blocks their owner freed
     * (each a failure) would cut off another's open in flight.  The rate limit still bounds them all. */
    return ok && (c->failures < MAX_CLIENT_FAILURES || c->pin_count > 0 || c->answered);
}

/* accept() fails with EMFILE when the process has no free descriptor, whether or not a
 * connection waits.  The spare makes room: a waiting connection is accepted, answered 507022
 * unread and closed, and the spare is taken back. */
typedef enum { SPARE_REFUSED, SPARE_QUEUE_EMPTY, SPARE_STUCK } spare_result;

static spare_result refuse_for_want_of_descriptors(int lfd)
{
    int spare = atomic_exchange(&spare_fd, -1);
    if (spare < 0)
        return SPARE_STUCK;
    close(spare);
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    int err = fd < 0 ? errno : 0;
    if (fd >= 0) {
        ipc_reply rp = refusal();
        (void)send_reply(fd, &rp, -1);
        close(fd);
    }
    /* -1 when another thread took the slot meanwhile: accept_clients tries again later */
    atomic_store(&spare_fd, open("/dev/null", O_RDONLY | O_CLOEXEC));
    return fd >= 0 ? SPARE_REFUSED : err == EAGAIN || err == EWOULDBLOCK ? SPARE_QUEUE_EMPTY : SPARE_STUCK;
}

/* Accepts and serves the queued connections.  False when one stays queued for want of
 * descriptors (and of the spare) or of memory: the listener must rest, or the server would spin
 * on it. */
static bool accept_clients(int lfd)
{
    if (atomic_load(&spare_fd) < 0)
        atomic_store(&spare_fd, open("/dev/null", O_RDONLY | O_CLOEXEC));
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return true;
            if (errno != EMFILE && errno != ENFILE)
                return false;
            spare_result r = refuse_for_want_of_descriptors(lfd);
            if (r == SPARE_REFUSED)
                continue;
            return r == SPARE_QUEUE_EMPTY;
        }
        struct ucred cr;
        socklen_t len = sizeof cr;
        if (nclients >= MAX_CLIENTS || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || cr.pid <= 0) {
            close(fd);
            continue;
        }
        bool uid_ok = uid_allowed(cr.uid);
        size_t foreign = 0;
        for (size_t i = 0; i < nclients && !uid_ok; i++)
            foreign += !clients[i].uid_ok;
        if (foreign >= MAX_FOREIGN_CLIENTS) { /* other users cannot fill the table */
            close(fd);
            continue;
        }
        client added = {.fd = fd, .pid = cr.pid, .uid = cr.uid, .who = peer_identity(fd, cr.pid), .uid_ok = uid_ok};
        pthread_mutex_lock(&ipc.lock); /* the table is fork-consistent (serve_close) */
        bool room = true;
        if (nclients == clients_cap) {
            size_t cap = clients_cap ? clients_cap * 2 : 16;
            client *grown = realloc(clients, cap * sizeof *grown);
            if (grown) {
                clients = grown;
                clients_cap = cap;
            }
            room = grown != NULL;
        }
        if (room) {
            clients[nclients++] = added;
            atomic_store(&ipc.client_count, nclients);
        }
        pthread_mutex_unlock(&ipc.lock);
        if (!room) {
            close(fd);
            continue;
        }
        /* The request usually follows the connect at once: serve it without another poll round. */
        if (!serve_client(nclients - 1))
            client_drop(nclients - 1);
    }
}

static void *server_main(void *arg)
{
    (void)arg;
    struct pollfd *pfds = NULL;
    size_t pcap = 0;
    uint64_t rest_until = 0; /* the listener is left out of the poll until then (0: it is not) */
    for (;;) {
        size_t want = nclients + 2;
        if (want > pcap) {
            struct pollfd *grown = realloc(pfds, want * sizeof *grown);
            if (!grown) {
                host_sleep_ns(1000000);
                continue;
            }
            pfds = grown;
            pcap = want;
        }
        pfds[0] = (struct pollfd){ipc.wake_fd, POLLIN, 0};
        pfds[1] = (struct pollfd){ipc.listen_fd, POLLIN, 0};
        for (size_t i = 0; i < nclients; i++)
            pfds[i + 2] = (struct pollfd){clients[i].fd, POLLIN, 0};
        size_t polled = nclients;
        int wait_ms = -1;
        if (rest_until) {
            uint64_t now = host_now_ns();
            if (now < rest_until) {
                pfds[1].fd = -1; /* ignored by poll */
                wait_ms = (int)((rest_until - now + 999999) / 1000000);
            } else {
                rest_until = 0;
            }
        }
        if (poll(pfds, polled + 2, wait_ms) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pfds[0].revents) {
            uint64_t v;
            if (read(ipc.wake_fd, &v, sizeof v) < 0) {
            }
            break; /* only ipc_shutdown wakes the server */
        }
        /* Clients from the last one down: dropping one moves the last into its slot. */
        for (size_t i = polled; i-- > 0;) {
            short ev = pfds[i + 2].revents;
            if (!ev)
                continue;
            /* A hang-up with messages still queued serves them first (one per round). */
            bool keep = (ev & POLLIN) ? serve_client(i) : false;
            if (!keep)
                client_drop(i);
        }
        if (pfds[1].revents && !accept_clients(ipc.listen_fd))
            rest_until = host_now_ns() + LISTEN_REST_NS;
    }
    free(pfds);
    return NULL;
}

static aclError ensure_server_locked(void)
{
    if (ipc.server_running)
        return ACL_SUCCESS;
    int32_t pid = self_pid();
    int lfd = -1;
    uint32_t secret = 0;
    for (int attempt = 0; attempt < 64 && lfd < 0; attempt++) {
        random_bytes(&secret, sizeof secret);
        secret &= (1u << IPC_SECRET_BITS) - 1;
        lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (lfd < 0)
            return ACL_ERROR_RT_IPC_ERROR;
        struct sockaddr_un a;
        socklen_t alen = make_addr(pid, secret, &a);
        if (bind(lfd, (struct sockaddr *)&a, alen) != 0) {
            int err = errno;
            close(lfd);
            lfd = -1;
            if (err != EADDRINUSE) /* in use: somebody squats the name; draw another secret */
                return ACL_ERROR_RT_IPC_ERROR;
        }
    }
    if (lfd < 0)
        return ACL_ERROR_RT_IPC_ERROR;
    int wfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    int spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (wfd < 0 || spare < 0 || listen(lfd, 256) != 0) {
        close(lfd);
        if (wfd >= 0)
            close(wfd);
        if (spare >= 0)
            close(spare);
        return ACL_ERROR_RT_IPC_ERROR;
    }
    atomic_store(&spare_fd, spare);
    ipc.listen_fd = lfd;
    ipc.wake_fd = wfd;
    ipc.secret = secret;
    /* The server takes no signals (they belong to the application's threads). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = pthread_create(&ipc.thread, NULL, server_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        close(lfd);
        close(wfd);
        close(atomic_exchange(&spare_fd, -1));
        ipc.listen_fd = ipc.wake_fd = -1;
        return ACL_ERROR_RT_IPC_ERROR;
    }
    ipc.server_running = true;
    return ACL_SUCCESS;
}

/* ---- the importing side ---- */

/* Checks that the listener a socket connected to is process `pid`, of a user this process
 * accepts: ACL_SUCCESS, ACL_ERROR_RT_INVALID_HANDLE (somebody else holds the name) or
 * ACL_ERROR_RT_DRV_INTERNAL_ERROR (not an accepted user). */
static aclError check_listener(int fd, int32_t pid)
{
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || cr.pid != pid)
        return ACL_ERROR_RT_INVALID_HANDLE; /* not the exporter the name names */
    return uid_allowed(cr.uid) ? ACL_SUCCESS : ACL_ERROR_RT_DRV_INTERNAL_ERROR;
}

static void set_socket_timeouts(int fd, uint64_t us)
{
    struct timeval tv = {(time_t)(us / 1000000u), (suseconds_t)(us % 1000000u)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

/* A signal interrupts a blocking call on a socket with timeouts (EINTR, even under SA_RESTART), and
 * a retry would wait the whole NPUALLOC_IPC_TIMEOUT_MS again: a periodic signal (a profiler's
 * timer) kept an import waiting for ever.  Retries get only what is left of the call's time. */
typedef struct call_budget {
    int fd;
    uint64_t started;
    uint64_t timeout_us; /* read at the first retry; 0 until then */
} call_budget;

static call_budget budget_start(int fd) { return (call_budget){fd, host_now_ns(), 0}; }

/* After EINTR: true to retry (the timeouts cut to the time left); false with errno EAGAIN when the
 * time is up, the error of a timeout. */
static bool budget_retry(call_budget *b)
{
    if (!b->timeout_us)
        b->timeout_us = (uint64_t)timeout_ms() * 1000u;
    uint64_t spent_us = (host_now_ns() - b->started) / 1000u;
    if (spent_us >= b->timeout_us) {
        errno = EAGAIN;
        return false;
    }
    set_socket_timeouts(b->fd, b->timeout_us - spent_us);
    return true;
}

/* The socket's next call gets the whole timeout again, if a retry cut it. */
static void budget_end(const call_budget *b)
{
    if (b->timeout_us)
        set_socket_timeouts(b->fd, b->timeout_us);
}

/* Connects to the server a key or share names and checks that it is that process, of an
 * accepted user; requests on the connection then wait up to NPUALLOC_IPC_TIMEOUT_MS. */
static aclError connect_exporter(int32_t pid, uint32_t secret, int *out)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) /* out of descriptors passes: try again, as for a value whose search had none */
        return errno == EMFILE || errno == ENFILE ? ACL_ERROR_RT_IPC_ERROR : ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
    set_socket_timeouts(fd, (uint64_t)timeout_ms() * 1000u);
    struct sockaddr_un a;
    socklen_t alen = make_addr(pid, secret, &a);
    call_budget budget = budget_start(fd);
    int rc;
    do
        rc = connect(fd, (struct sockaddr *)&a, alen);
    while (rc != 0 && errno == EINTR && budget_retry(&budget));
    int err = rc != 0 ? errno : 0;
    budget_end(&budget);
    if (rc != 0) {
        close(fd);
        /* nobody listens there: the exporter exited, never exported, or the key is forged */
        return err == EAGAIN || err == ETIMEDOUT ? ACL_ERROR_RT_IPC_ERROR : ACL_ERROR_RT_INVALID_HANDLE;
    }
    aclError checked = check_listener(fd, pid);
    if (checked != ACL_SUCCESS) {
        close(fd);
        return checked;
    }
    *out = fd;
    return ACL_SUCCESS;
}

/* The owner's protocol version when a reply of another version made this thread's last
 * request fail (ipc_last_peer_version). */
static _Thread_local uint16_t peer_version;

uint16_t ipc_last_peer_version(void) { return peer_version; }

/* Sends a request: 0, or the errno of the failure. */
static int send_request(int sock, uint16_t op, uint32_t id, uint64_t value, const uint8_t *token, int flags)
{
    ipc_request rq;
    memset(&rq, 0, sizeof rq);
    rq.magic = IPC_MAGIC;
    rq.version = IPC_VERSION;
    rq.op = op;
    rq.id = id;
    rq.claimed_pid = self_pid(); /* informational only: the exporter does not read it */
    rq.value = value;
    if (token)
        memcpy(rq.token, token, 16);
    call_budget budget = budget_start(sock);
    ssize_t n;
    do
        n = send(sock, &rq, sizeof rq, MSG_NOSIGNAL | flags);
    while (n < 0 && errno == EINTR && budget_retry(&budget));
    int err = n == (ssize_t)sizeof rq ? 0 : n < 0 ? errno : EPROTO;
    budget_end(&budget);
    return err;
}

/* Receives a reply (and a descriptor, if one comes).  ACL_ERROR_RT_INVALID_HANDLE when the
 * exporter hung up without one, 507022 when none came in time or it is malformed or of another
 * protocol version (peer_version then says which); with MSG_DONTWAIT, *waiting tells a reply
 * not there yet (507022 then) from the rest.  The caller checks the id. */
static aclError recv_reply(int sock, int flags, ipc_reply *rp, int *fd, bool *waiting)
{
    struct iovec iov = {rp, sizeof *rp};
    union {
        char buf[CMSG_SPACE(sizeof(int) * 4)];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    call_budget budget = budget_start(sock);
    ssize_t n;
    do
        n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
    while (n < 0 && errno == EINTR && budget_retry(&budget));
    int err = n < 0 ? errno : 0;
    budget_end(&budget);
    if (err == ECONNRESET) {
        /* The exporter closed with our request unread (one that could not serve answers before
         * reading): the kernel reports the reset first, then the answer still queued. */
        msg.msg_controllen = sizeof u.buf;
        n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (n >= 0)
            err = 0;
    }
    if (waiting)
        *waiting = n < 0 && (err == EAGAIN || err == EWOULDBLOCK);
    int got = -1;
    for (struct cmsghdr *cm = n >= 0 ? CMSG_FIRSTHDR(&msg) : NULL; cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < count; i++) {
                int f;
                memcpy(&f, CMSG_DATA(cm) + i * sizeof(int), sizeof f);
                if (got < 0)
                    got = f;
                else
                    close(f); /* more than we asked for */
            }
        }
    }
    aclError rc = ACL_SUCCESS;
    if (n == 0 || (n < 0 && err != EAGAIN && err != EWOULDBLOCK && err != ETIMEDOUT)) {
        rc = ACL_ERROR_RT_INVALID_HANDLE; /* the exporter went away */
    } else if (n == IPC_V1_REPLY_SIZE && rp->magic == IPC_MAGIC) {
        rc = ACL_ERROR_RT_IPC_ERROR; /* version 1's reply, the one without a version field */
        peer_version = 1;
    } else if (n >= 8 && rp->magic == IPC_MAGIC && rp->version != IPC_VERSION) {
        rc = ACL_ERROR_RT_IPC_ERROR; /* magic and version open every later version's reply */
        peer_version = rp->version;
    } else if (n != (ssize_t)sizeof *rp || rp->magic != IPC_MAGIC || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        rc = ACL_ERROR_RT_IPC_ERROR;
    }
    if (rc != ACL_SUCCESS || !fd) {
        if (got >= 0)
            close(got);
    } else {
        *fd = got;
    }
    return rc;
}

/* The id of the request of a connection that carries only one (imports by key, searches). */
#define ONE_SHOT_ID 1

/* Is a reply the one to request `id`?  Id 0 answers a request refused unread. */
static bool answers(const ipc_reply *rp, uint32_t id) { return rp->id == id || rp->id == 0; }

/* recv_reply on a connection that carries one request (ONE_SHOT_ID): a reply to another id breaks
 * the protocol (507022, its descriptor closed). */
static aclError recv_one_shot_reply(int sock, int flags, ipc_reply *rp, int *fd, bool *waiting)
{
    aclError rc = recv_reply(sock, flags, rp, fd, waiting);
    if (rc == ACL_SUCCESS && !answers(rp, ONE_SHOT_ID)) {
        if (*fd >= 0) {
            close(*fd);
            *fd = -1;
        }
        rc = ACL_ERROR_RT_IPC_ERROR;
    }
    return rc;
}

/* Sends the one request of a connection and waits for the reply (and a descriptor, if one
 * comes). */
static aclError roundtrip(int sock, uint16_t op, uint64_t value, const uint8_t *token, ipc_reply *rp, int *fd)
{
    int err = send_request(sock, op, ONE_SHOT_ID, value, token, 0);
    if (err == EAGAIN || err == ETIMEDOUT)
        return ACL_ERROR_RT_IPC_ERROR;
    if (!err)
        return recv_one_shot_reply(sock, 0, rp, fd, NULL);
    /* An exporter that could not serve (out of descriptors) answers before reading and hangs up:
     * its answer may be here although the send failed. */
    bool none;
    aclError rc = recv_one_shot_reply(sock, MSG_DONTWAIT, rp, fd, &none);
    return none ? ACL_ERROR_RT_INVALID_HANDLE : rc;
}

/* ---- sessions: an opener's connection to an owner, many requests (see "Request ids") ---- */

/* The owner hung up or broke the protocol (s->lock held). */
static void session_kill(session *s)
{
    pthread_mutex_lock(&ipc.lock);
    s->dead = true;
    pthread_mutex_unlock(&ipc.lock);
}

static bool session_dead(session *s)
{
    pthread_mutex_lock(&ipc.lock);
    bool dead = s->dead;
    pthread_mutex_unlock(&ipc.lock);
    return dead;
}

static uint32_t session_next_id(session *s)
{
    uint32_t id = s->next_id++;
    if (s->next_id == 0)
        s->next_id = 1;
    return id;
}

/* Sends the CANCEL the session owes, if any (s->lock held): 0, or the errno of the failure. */
static int session_pay_cancel(session *s, int flags)
{
    if (!s->cancel_of)
        return 0;
    int err = send_request(s->fd, IPC_OP_CANCEL, session_next_id(s), s->cancel_of, NULL, flags);
    if (!err)
        s->cancel_of = 0;
    return err;
}

/* A request on a session and its reply (s->lock held).  Late replies to earlier requests that
 * timed out are read and dropped on the way (with their descriptors); after a timeout of an
 * OPEN, its CANCEL is owed before anything else is sent.  Only a hang-up or a reply that breaks
 * the protocol gives the session up; a timeout leaves it usable. */
static aclError session_roundtrip(session *s, uint16_t op, uint64_t value, const uint8_t *token, ipc_reply *rp,
                                  int *fd)
{
    if (s->dead)
        return ACL_ERROR_RT_IPC_ERROR;
    int err = session_pay_cancel(s, 0);
    uint32_t id = 0;
    if (!err) {
        id = session_next_id(s);
        err = send_request(s->fd, op, id, value, token, 0);
    }
    if (err == EAGAIN || err == ETIMEDOUT)
        return ACL_ERROR_RT_IPC_ERROR; /* not sent (a SEQPACKET message goes whole or not at all) */
    const uint64_t deadline = host_now_ns() + (uint64_t)timeout_ms() * 1000000u;
    for (;;) {
        uint64_t now = host_now_ns();
        struct pollfd pfd = {s->fd, POLLIN, 0};
        int ready = err ? 1 : now < deadline ? poll(&pfd, 1, (int)((deadline - now + 999999) / 1000000)) : 0;
        if (ready < 0 && errno == EINTR)
            continue;
        if (ready <= 0) { /* unanswered (or poll failed): a late reply is dropped by the next request */
            if (op == IPC_OP_OPEN) {
                s->cancel_of = id;
                (void)session_pay_cancel(s, MSG_DONTWAIT); /* or before the next request */
            }
            return ACL_ERROR_RT_IPC_ERROR;
        }
        bool none = false;
        int got = -1;
        aclError rc = recv_reply(s->fd, MSG_DONTWAIT, rp, &got, &none);
        if (none && !err)
            continue; /* woken for nothing */
        if (none || rc != ACL_SUCCESS) {
            /* The send failed and nothing came (the owner hung up), or it hung up since, or it
             * broke the protocol */
            session_kill(s);
            return none ? ACL_ERROR_RT_INVALID_HANDLE : rc;
        }
        if (answers(rp, id)) {
            if (fd)
                *fd = got;
            else if (got >= 0)
                close(got);
            s->last_reply = id;
            return ACL_SUCCESS;
        }
        if (got >= 0)
            close(got); /* a late import's descriptor */
        /* A late reply comes after the last one read and before ours; anything else is not a
         * reply to this session's requests. */
        if (rp->id == s->last_reply || (uint32_t)(rp->id - s->last_reply) >= (uint32_t)(id - s->last_reply)) {
            session_kill(s);
            return ACL_ERROR_RT_IPC_ERROR;
        }
        s->last_reply = rp->id;
    }
}

/* ---- finding the server that exported a value (see ipc.h) ---- */

static void known_remember(server_id id)
{
    pthread_mutex_lock(&ipc.lock);
    size_t i = 0;
    while (i < nknown && !(known[i].pid == id.pid && known[i].secret == id.secret))
        i++;
    if (i == nknown && nknown < KNOWN_SERVERS)
        nknown++;
    if (i == KNOWN_SERVERS)
        i--; /* forget the least recent */
    memmove(&known[1], &known[0], i * sizeof known[0]);
    known[0] = id;
    pthread_mutex_unlock(&ipc.lock);
}

static void known_forget(server_id id)
{
    pthread_mutex_lock(&ipc.lock);
    for (size_t i = 0; i < nknown; i++) {
        if (known[i].pid == id.pid && known[i].secret == id.secret) {
            memmove(&known[i], &known[i + 1], (--nknown - i) * sizeof known[0]);
            break;
        }
    }
    pthread_mutex_unlock(&ipc.lock);
}

/* The listening npualloc servers of this network namespace, other than this process's (a malloc'ed
 * array, NULL when there are none or /proc/net/unix cannot be read).  *short_of_resources: the list is
 * incomplete for want of a descriptor or memory, which passes; a server it misses may have the value. */
static server_id *list_servers(size_t *count, bool *short_of_resources)
{
    *count = 0;
    *short_of_resources = false;
    FILE *f = fopen("/proc/net/unix", "re");
    if (!f) {
        *short_of_resources = errno == EMFILE || errno == ENFILE || errno == ENOMEM;
        return NULL;
    }
    server_id *out = NULL;
    size_t cap = 0;
    char line[512], path[256], canon[64];
    while (fgets(line, sizeof line, f)) {
        unsigned flags = 0;
        /* Num RefCount Protocol Flags Type St Inode Path; __SO_ACCEPTCON (0x10000): listening */
        if (sscanf(line, "%*s %*s %*s %x %*s %*s %*s %255s", &flags, path) != 2 || !(flags & 0x10000) ||
            strncmp(path, "@npualloc-ipc-", 14) != 0)
            continue;
        int pid = 0;
        unsigned secret = 0;
        if (sscanf(path + 14, "%d-%x", &pid, &secret) != 2 || pid <= 0 || pid >= (1 << IPC_PID_BITS) ||
            secret >= (1u << IPC_SECRET_BITS) || pid == self_pid())
            continue;
        ipc_server_name(pid, secret, canon, sizeof canon);
        if (strcmp(canon, path + 1) != 0)
            continue;
        if (*count == cap) {
            size_t ncap = cap ? cap * 2 : 16;
            server_id *grown = realloc(out, ncap * sizeof *grown);
            if (!grown) {
                *short_of_resources = true;
                break;
            }
            out = grown;
            cap = ncap;
        }
        out[(*count)++] = (server_id){pid, secret};
    }
    fclose(f);
    return out;
}

/* What asking one server came to.  ASK_SENT: the request is on its way; ASK_NO_FD: this
 * process had no descriptor for the connection. */
typedef enum { ASK_SENT, ASK_ANSWER, ASK_MISS, ASK_BUSY, ASK_DENIED, ASK_GONE, ASK_NO_FD } ask_result;

/* Connects to a server without waiting (a listener whose queue is full counts as busy), checks
 * it, and sends the request without waiting. */
static ask_result ask_start(server_id id, uint16_t op, uint64_t value, int *out)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return ASK_NO_FD;
    struct sockaddr_un a;
    socklen_t alen = make_addr(id.pid, id.secret, &a);
    int rc;
    do
        rc = connect(fd, (struct sockaddr *)&a, alen);
    while (rc != 0 && errno == EINTR);
    aclError checked = rc == 0 ? check_listener(fd, id.pid) : ACL_SUCCESS;
    int err = rc != 0                ? errno
              : checked == ACL_SUCCESS ? send_request(fd, op, ONE_SHOT_ID, value, NULL, MSG_DONTWAIT)
                                       : 0;
    ask_result r = ASK_SENT;
    if (rc != 0) /* EAGAIN: its queue is full; otherwise nobody listens there any more */
        r = err == EAGAIN ? ASK_BUSY : ASK_GONE;
    else if (checked != ACL_SUCCESS) /* the value is never sent to such a listener */
        r = checked == ACL_ERROR_RT_DRV_INTERNAL_ERROR ? ASK_DENIED : ASK_GONE;
    else if (err == EAGAIN)
        r = ASK_BUSY;
    /* Any other send failure: the server hung up, maybe after an answer (one that could not
     * serve answers before reading): the reply, or the hang-up, is read like any other. */
    if (r != ASK_SENT)
        close(fd);
    else
        *out = fd;
    return r;
}

/* Reads a server's answer: ASK_SENT when it is not there yet. */
static ask_result ask_finish(int sock, ipc_reply *rp, int *fd)
{
    bool waiting;
    aclError rc = recv_one_shot_reply(sock, MSG_DONTWAIT, rp, fd, &waiting);
    if (waiting)
        return ASK_SENT;
    if (rc != ACL_SUCCESS)
        return rc == ACL_ERROR_RT_IPC_ERROR ? ASK_BUSY : ASK_GONE;
    if (rp->status == ACL_SUCCESS)
        return ASK_ANSWER;
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
    return rp->status == ACL_ERROR_RT_INVALID_HANDLE ? ASK_MISS
           : rp->status == ACL_ERROR_RT_IPC_ERROR    ? ASK_BUSY
                                                     : ASK_ANSWER;
}

#define SEARCH_AT_ONCE 32              /* servers asked at the same time */
#define SEARCH_KNOWN_ALONE_NS 10000000u /* the known servers are asked alone for 10 ms at most */

/* A server asked and not answered yet. */
typedef struct asking {
    int fd;
    server_id id;
    uint64_t deadline; /* ns: silent until then, it counts as busy */
} asking;

static bool same_server(server_id a, server_id b) { return a.pid == b.pid && a.secret == b.secret; }

/* Asks the servers this process may reach until one knows the value: its reply (status 0 or the
 * exporter's refusal), or the error of nobody knowing it.  Servers are asked at the same time
 * (SEARCH_AT_ONCE of them), the known ones first and alone for up to 10 ms, and each gets a tenth
 * of NPUALLOC_IPC_TIMEOUT_MS to answer: a listener that never answers costs that window, not the
 * timeout, and delays nothing when another server has the value. */
static aclError ask_servers(uint16_t op, uint64_t value, ipc_reply *rp, int *fd)
{
    server_id first[KNOWN_SERVERS];
    pthread_mutex_lock(&ipc.lock);
    size_t nfirst = nknown;
    memcpy(first, known, nknown * sizeof known[0]);
    pthread_mutex_unlock(&ipc.lock);
    const uint64_t window = (uint64_t)timeout_ms() * 100000u; /* a tenth of the timeout, in ns */
    const uint64_t list_at = host_now_ns() + SEARCH_KNOWN_ALONE_NS;
    server_id *listed = NULL;
    size_t nlisted = 0, next_first = 0, next_listed = 0;
    bool listing = false, busy = false, denied = false, found = false;
    asking flight[SEARCH_AT_ONCE];
    struct pollfd pfds[SEARCH_AT_ONCE];
    size_t nflight = 0;
    *fd = -1;
    while (!found) {
        uint64_t now = host_now_ns();
        /* everybody else once the known servers all answered, or after 10 ms */
        if (!listing && next_first == nfirst && (nflight == 0 || now >= list_at)) {
            bool short_of_resources;
            listed = list_servers(&nlisted, &short_of_resources);
            busy |= short_of_resources; /* as a server this process had no descriptor to ask */
            listing = true;
        }
        while (nflight < SEARCH_AT_ONCE && (next_first < nfirst || next_listed < nlisted)) {
            bool is_known = next_first < nfirst;
            server_id id = is_known ? first[next_first] : listed[next_listed];
            bool asked = false;
            for (size_t j = 0; j < nfirst && !is_known && !asked; j++)
                asked = same_server(first[j], id);
            int sock = -1;
            ask_result r = asked ? ASK_MISS : ask_start(id, op, value, &sock);
            if (r == ASK_NO_FD && nflight > 0)
                break; /* again once a connection in flight is closed */
            next_first += is_known;
            next_listed += !is_known;
            if (r == ASK_SENT)
                flight[nflight++] = (asking){sock, id, now + window};
            else if (r == ASK_GONE)
                known_forget(id);
            busy |= r == ASK_BUSY || r == ASK_NO_FD;
            denied |= r == ASK_DENIED;
        }
        if (nflight == 0) {
            if (listing)
                break; /* everybody answered */
            continue;
        }
        uint64_t until = listing ? UINT64_MAX : list_at;
        for (size_t i = 0; i < nflight; i++)
            if (flight[i].deadline < until)
                until = flight[i].deadline;
        for (size_t i = 0; i < nflight; i++)
            pfds[i] = (struct pollfd){flight[i].fd, POLLIN, 0};
        int wait_ms = until > now ? (int)((until - now + 999999) / 1000000) : 0;
        bool cannot_wait = poll(pfds, nflight, wait_ms) < 0 && errno != EINTR;
        now = host_now_ns();
        for (size_t i = nflight; i-- > 0;) {
            ipc_reply got;
            int got_fd = -1;
            ask_result r = pfds[i].revents ? ask_finish(flight[i].fd, &got, &got_fd) : ASK_SENT;
            if (r == ASK_SENT && now < flight[i].deadline && !cannot_wait)
                continue;
            if (r == ASK_SENT)
                r = ASK_BUSY; /* silent for its whole window (or poll failed) */
            close(flight[i].fd);
            server_id id = flight[i].id;
            flight[i] = flight[--nflight];
            if (r == ASK_GONE)
                known_forget(id);
            if (r == ASK_ANSWER && !found) {
                found = true;
                *rp = got;
                *fd = got_fd;
                known_remember(id);
            } else if (r == ASK_ANSWER && got_fd >= 0) {
                close(got_fd); /* a second server claims it: the first answer stands */
            }
            busy |= r == ASK_BUSY;
        }
    }
    for (size_t i = 0; i < nflight; i++)
        close(flight[i].fd);
    free(listed);
    if (found)
        return ACL_SUCCESS;
    return busy ? ACL_ERROR_RT_IPC_ERROR : denied ? ACL_ERROR_RT_DRV_INTERNAL_ERROR : ACL_ERROR_RT_INVALID_HANDLE;
}

typedef struct import_spec {
    bool is_key;
    uint64_t value;    /* values */
    uint8_t token[16]; /* keys */
    int32_t exporter;
    uint32_t secret;
    int32_t key_device; /* keys: the device named in the key */
    int32_t device;     /* the device to import for */
    session *s;         /* open_shared's session (its lock held), or NULL: a connection of its own */
} import_spec;

static import_entry *import_find(const import_spec *sp)
{
    for (import_entry *i = ipc.imports; i; i = i->next) {
        if (i->is_key != sp->is_key || i->device != sp->device)
            continue;
        if (sp->is_key ? (i->exporter == sp->exporter && memcmp(i->token, sp->token, 16) == 0)
                       : i->value == sp->value)
            return i;
    }
    return NULL;
}

static void import_unlink(import_entry *e)
{
    for (import_entry **link = &ipc.imports; *link; link = &(*link)->next) {
        if (*link == e) {
            *link = e->next;
            return;
        }
    }
}

/* Imports the memory a value or key names, as a handle of this process; a repeated import of
 * the same memory for the same device returns the same handle with one more reference. */
static aclError import_handle(const import_spec *sp, uint64_t *handle_out, size_t *size_out)
{
    pthread_mutex_lock(&ipc.lock);
    import_entry *e;
    while ((e = import_find(sp)) != NULL) {
        if (e->pending) {
            pthread_cond_wait(&ipc.cond, &ipc.lock);
            continue;
        }
        if (vmm_handle_retain(e->handle_id, e->serial)) {
            *handle_out = e->handle_id;
            *size_out = e->size;
            pthread_mutex_unlock(&ipc.lock);
            return ACL_SUCCESS;
        }
        import_unlink(e); /* freed meanwhile: import anew */
        free(e);
    }
    e = calloc(1, sizeof *e);
    if (!e) {
        pthread_mutex_unlock(&ipc.lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    e->is_key = sp->is_key;
    e->value = sp->value;
    memcpy(e->token, sp->token, 16);
    e->exporter = sp->exporter;
    e->device = sp->device;
    e->pending = true;
    e->next = ipc.imports;
    ipc.imports = e;
    pthread_mutex_unlock(&ipc.lock);

    aclError rc = ACL_SUCCESS;
    ipc_reply rp;
    int fd = -1;
    uint16_t op = sp->is_key ? IPC_OP_IMPORT_KEY : IPC_OP_IMPORT;
    uint64_t value = sp->is_key ? (uint64_t)sp->key_device : sp->value;
    const uint8_t *token = sp->is_key ? sp->token : NULL;
    if (sp->s) {
        rc = session_roundtrip(sp->s, op, value, token, &rp, &fd);
    } else if (!sp->is_key) {
        rc = ask_servers(IPC_OP_IMPORT, sp->value, &rp, &fd); /* nothing in a value names its exporter */
    } else {
        int sock = -1;
        rc = connect_exporter(sp->exporter, sp->secret, &sock);
        if (rc == ACL_SUCCESS) {
            rc = roundtrip(sock, op, value, token, &rp, &fd);
            close(sock);
        }
    }
    if (rc == ACL_SUCCESS && rp.status != ACL_SUCCESS)
        rc = rp.status;
    if (rc == ACL_SUCCESS && (fd < 0 || rp.kind >= MEM_KIND_COUNT || rp.size == 0))
        rc = ACL_ERROR_RT_IPC_ERROR;
    /* Only a file whose size is sealed can be mapped safely (nobody can shrink it under us). */
    int seals = rc == ACL_SUCCESS ? fcntl(fd, F_GET_SEALS) : 0;
    if (rc == ACL_SUCCESS && (seals < 0 || (seals & F_SEAL_SHRINK) == 0))
        rc = ACL_ERROR_RT_IPC_ERROR;
    /* Peer access rule: memory of another device needs peer access between the two. */
    if (rc == ACL_SUCCESS && rp.device != sp->device &&
        (!device_valid(rp.device) || !device_peer_enabled(sp->device, rp.device)))
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    aclrtDrvMemHandle h = NULL;
    uint64_t serial = 0;
    if (rc == ACL_SUCCESS) {
        rc = vmm_physical_adopt(sp->device, (mem_kind)rp.kind, (size_t)rp.size, fd, &h, &serial);
        fd = -1; /* taken */
    }
    if (fd >= 0)
        close(fd);

    pthread_mutex_lock(&ipc.lock);
    e->pending = false;
    if (rc == ACL_SUCCESS) {
        e->handle_id = (uint64_t)(uintptr_t)h;
        e->serial = serial;
        e->size = (size_t)rp.size;
        *handle_out = e->handle_id;
        *size_out = e->size;
    } else {
        import_unlink(e);
        free(e);
    }
    pthread_cond_broadcast(&ipc.cond);
    pthread_mutex_unlock(&ipc.lock);
    return rc;
}

/* ---- shareable handles (aclrt*) ---- */

aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle, aclrtMemHandleType handleType, uint64_t flags,
                                         uint64_t *shareableHandle)
{
    if (!handle || handleType != ACL_MEM_HANDLE_TYPE_NONE || !shareableHandle)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (flags > ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return ACL_ERROR_RT_PARAM_INVALID;
    vmm_share_ref ref;
    vmm_share_info info;
    if ((rc = vmm_share_ref_handle(handle, &ref, &info)) != ACL_SUCCESS)
        return rc;
    if (info.imported)
        return ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* memory of another process: it has its own value */
    if (info.device < 0)
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* host-resident physical memory */
    pthread_mutex_lock(&ipc.lock);
    export_entry *e = export_by_serial(ref.serial);
    if (e && e->user) {
        rc = ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* one shareable handle per handle ("Blk has been shared") */
    } else if (e) {
        e->user = true; /* exported by npualloc.share before: the same value becomes the user's */
        e->flags = flags;
    } else {
        rc = export_create(&ref, &info, false, true, flags, &e);
    }
    if (rc == ACL_SUCCESS)
        *shareableHandle = e->value;
    pthread_mutex_unlock(&ipc.lock);
    return rc;
}

/* Set-pid for a value or key of this process (ipc.lock taken here). */
static aclError set_pids(export_entry *(*find)(const void *), const void *what, bool own, const int32_t *pid,
                         size_t n)
{
    if (!own)
        return ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* only the exporter may set pids (-EACCES) */
    pthread_mutex_lock(&ipc.lock);
    export_entry *e = find(what);
    aclError rc;
    if (!e || !e->user || e->gone)
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    else if (e->flags & ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        rc = ACL_ERROR_RT_NO_PERMISSION; /* "Had set no need wlist" */
    else
        rc = add_pids(e, pid, n);
    pthread_mutex_unlock(&ipc.lock);
    return rc;
}

static export_entry *find_value_of(const void *what) { return export_by_value(*(const uint64_t *)what); }

aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid, size_t pidNum)
{
    if (!pid || pidNum == 0)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&ipc.lock);
    bool own = export_by_value(shareableHandle) != NULL;
    pthread_mutex_unlock(&ipc.lock);
    if (!own) { /* a value of another process (only its exporter may set pids), or nobody's */
        ipc_reply rp;
        int fd = -1;
        rc = ask_servers(IPC_OP_PROBE, shareableHandle, &rp, &fd);
        if (fd >= 0) /* a probe's answer carries none; a peer that sends one anyway must not cost us it */
            close(fd);
        return rc == ACL_SUCCESS ? ACL_ERROR_RT_DRV_INTERNAL_ERROR : ACL_ERROR_RT_INVALID_HANDLE;
    }
    return set_pids(find_value_of, &shareableHandle, true, pid, pidNum);
}

aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId, aclrtDrvMemHandle *handle)
{
    if (!handle)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(deviceId))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    pthread_mutex_lock(&ipc.lock);
    bool mine = export_by_value(shareableHandle) != NULL;
    pthread_mutex_unlock(&ipc.lock);
    if (mine)
        return ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* "Export process can not import" */
    if ((shareableHandle & ~IPC_VALUE_DEVICE_MASK) == 0)
        return ACL_ERROR_RT_INVALID_HANDLE; /* never a value */
    import_spec sp = {.is_key = false, .value = shareableHandle, .device = deviceId};
    uint64_t h = 0;
    size_t size = 0;
    if ((rc = import_handle(&sp, &h, &size)) == ACL_SUCCESS)
        *handle = (aclrtDrvMemHandle)(uintptr_t)h;
    return rc;
}

aclError aclrtDeviceGetBareTgid(int32_t *pid)
{
    if (!pid)
        return ACL_ERROR_INVALID_PARAM;
    /* CANN translates a container's pid to the host's; here the exporter and the importer see
     * pids in the same namespace, and SO_PEERCRED reports them in the exporter's. */
    *pid = (int32_t)getpid();
    return ACL_SUCCESS;
}

/* ---- IPC keys ---- */

aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags)
{
    if (!devPtr || !key)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    /* CANN's ACL layer checks only the pointers; its runtime refuses the rest as parameters */
    if (size == 0 || len == 0 || flags > ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION)
        return ACL_ERROR_RT_PARAM_INVALID;
    vmm_share_ref ref;
    vmm_share_info info;
    if (vmm_share_ref_malloc(devPtr, &ref, &info) != ACL_SUCCESS || size > info.size)
        return ACL_ERROR_RT_PARAM_INVALID; /* not the start of an aclrtMalloc allocation */
    pthread_mutex_lock(&ipc.lock);
    export_entry *e = export_by_serial(ref.serial);
    if (e) {
        /* One key per allocation: asking again gives the same key (its first flags stay). */
        if (!e->user) {
            e->user = true;
            e->flags = flags;
        }
    } else {
        rc = export_create(&ref, &info, true, true, flags, &e);
    }
    if (rc == ACL_SUCCESS) {
        size_t need = strlen(e->key) + 1;
        if (len < need)
            rc = ACL_ERROR_INVALID_PARAM;
        else
            memcpy(key, e->key, need);
    }
    pthread_mutex_unlock(&ipc.lock);
    return rc;
}

typedef struct key_parts {
    int32_t pid, device;
    uint32_t secret;
    uint8_t token[16];
} key_parts;

static export_entry *find_key_of(const void *what)
{
    const key_parts *k = what;
    return k->secret == ipc.secret ? export_by_token(k->token, k->device) : NULL;
}

aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num)
{
    if (!key || !pid)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (num == 0 || num > INT32_MAX) /* CANN's runtime takes the count as an int32 > 0 */
        return ACL_ERROR_RT_PARAM_INVALID;
    key_parts k;
    if (!parse_key(key, &k.pid, &k.secret, &k.device, k.token))
        return ACL_ERROR_RT_INVALID_HANDLE;
    return set_pids(find_key_of, &k, k.pid == self_pid(), pid, num);
}

static key_import *key_import_find(const char *key, int32_t device)
{
    for (key_import *k = ipc.key_imports; k; k = k->next)
        if (k->device == device && strcmp(k->key, key) == 0)
            return k;
    return NULL;
}

aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags)
{
    if (!devPtr || !key)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (flags > ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS)
        return ACL_ERROR_RT_PARAM_INVALID;
    key_parts k;
    if (!parse_key(key, &k.pid, &k.secret, &k.device, k.token))
        return ACL_ERROR_RT_INVALID_HANDLE;
    if (k.pid == self_pid()) {
        pthread_mutex_lock(&ipc.lock);
        bool mine = find_key_of(&k) != NULL;
        pthread_mutex_unlock(&ipc.lock);
        return mine ? ACL_ERROR_RT_DRV_INTERNAL_ERROR : ACL_ERROR_RT_INVALID_HANDLE;
    }
    /* Mapped for the current device (the key's own device without a current one). */
    int32_t target;
    bool current = device_current(&target) == ACL_SUCCESS;
    if (!current)
        target = k.device;
    if (!device_valid(target))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if (current && target != k.device && device_valid(k.device) &&
        (flags & ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS) && !device_peer_enabled(target, k.device))
        (void)aclrtDeviceEnablePeerAccess(k.device, 0);
    pthread_mutex_lock(&ipc.lock);
    key_import *ki = key_import_find(key, target);
    if (ki) {
        ki->refs++;
        *devPtr = ki->ptr;
        pthread_mutex_unlock(&ipc.lock);
        return ACL_SUCCESS;
    }
    pthread_mutex_unlock(&ipc.lock);

    import_spec sp = {.is_key = true, .exporter = k.pid, .secret = k.secret, .key_device = k.device,
                      .device = target};
    memcpy(sp.token, k.token, 16);
    uint64_t h = 0;
    size_t size = 0;
    if ((rc = import_handle(&sp, &h, &size)) != ACL_SUCCESS)
        return rc;
    /* A range of the runtime's own: the user cannot unmap or release it under aclrtIpcMemClose. */
    void *va = NULL;
    rc = vmm_reserve_private(target, size, &va);
    if (rc == ACL_SUCCESS && (rc = vmm_map_private(va, size, (aclrtDrvMemHandle)(uintptr_t)h)) != ACL_SUCCESS) {
        vmm_release_private(va);
        va = NULL;
    }
    ki = rc == ACL_SUCCESS ? calloc(1, sizeof *ki) : NULL;
    if (rc == ACL_SUCCESS && !ki)
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    key_import *other = NULL;
    if (rc == ACL_SUCCESS) {
        pthread_mutex_lock(&ipc.lock);
        other = key_import_find(key, target); /* another thread imported it meanwhile */
        if (other) {
            other->refs++;
            *devPtr = other->ptr;
        } else {
            snprintf(ki->key, sizeof ki->key, "%s", key);
            ki->device = target;
            ki->ptr = va;
            ki->handle_id = h;
            ki->refs = 1;
            ki->next = ipc.key_imports;
            ipc.key_imports = ki;
            *devPtr = va;
        }
        pthread_mutex_unlock(&ipc.lock);
    }
    if (rc != ACL_SUCCESS || other) {
        free(other ? ki : NULL);
        if (va) {
            vmm_unmap_private(va);
            vmm_release_private(va);
        }
        aclrtFreePhysical((aclrtDrvMemHandle)(uintptr_t)h);
    }
    return rc;
}

aclError aclrtIpcMemClose(const char *key)
{
    if (!key)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&ipc.lock);
    /* An importer closes its mapping (the last close of several imports)... */
    key_import *found = NULL;
    bool last = false; /* decided under the lock: another close may free `found` once it is out */
    for (key_import **link = &ipc.key_imports; *link; link = &(*link)->next) {
        if (strncmp((*link)->key, key, IPC_KEY_LEN) == 0) {
            found = *link;
            if ((last = --found->refs == 0))
                *link = found->next;
            break;
        }
    }
    if (found) {
        pthread_mutex_unlock(&ipc.lock);
        if (last) {
            vmm_unmap_private(found->ptr);
            vmm_release_private(found->ptr);
            aclrtFreePhysical((aclrtDrvMemHandle)(uintptr_t)found->handle_id);
            free(found);
        }
        return ACL_SUCCESS;
    }
    /* ...the exporter stops sharing (importers keep what they mapped). */
    key_parts k;
    export_entry *e = NULL;
    if (parse_key(key, &k.pid, &k.secret, &k.device, k.token) && k.pid == self_pid())
        e = find_key_of(&k);
    if (e && e->user) {
        e->user = false;
        e->pid_count = 0; /* a share record may keep the export: a key exported again lists nobody yet */
        export_maybe_remove(e);
    } else {
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    }
    pthread_mutex_unlock(&ipc.lock);
    return rc;
}

/* ---- caching-allocator shares ---- */

/* Descriptor: this header, then `count` shareable values ('e'). */
typedef struct share_desc {
    char magic[4]; /* "NPUS" */
    uint8_t version;
    char kind; /* 'c' or 'e' */
    uint16_t reserved;
    int32_t pid;
    uint32_t secret;
    int32_t device;
    uint32_t count;
    uint8_t token[16];     /* the share: OPEN/CLOSE */
    uint64_t offset;       /* of the block in the first page ('e') or in the segment ('c') */
    uint64_t size;         /* the block's size */
    uint64_t page_size;    /* 'e' */
    uint8_t key_token[16]; /* 'c': the segment's key token */
} share_desc;

/* Deletes a share record (ipc.lock held) and the exports only it needed. */
static void share_delete(share_record *rec)
{
    for (share_record **link = &ipc.shares; *link; link = &(*link)->next) {
        if (*link == rec) {
            *link = rec->next;
            break;
        }
    }
    for (size_t i = 0; i < rec->count; i++) {
        rec->entries[i]->share_refs--;
        export_maybe_remove(rec->entries[i]);
    }
    free(rec->entries);
    free(rec);
}

/* The export of a page handle or segment for a share (ipc.lock held; the device lock too). */
static aclError share_export(bool is_key, uintptr_t what, export_entry **out)
{
    vmm_share_ref ref;
    vmm_share_info info;
    aclError rc = is_key ? vmm_share_ref_malloc((const void *)what, &ref, &info)
                         : vmm_share_ref_handle((aclrtDrvMemHandle)what, &ref, &info);
    if (rc != ACL_SUCCESS)
        return ACL_ERROR_RT_INVALID_HANDLE;
    export_entry *e = export_by_serial(ref.serial);
    if (!e && (rc = export_create(&ref, &info, is_key, false, 0, &e)) != ACL_SUCCESS)
        return rc;
    e->share_refs++;
    *out = e;
    return ACL_SUCCESS;
}

static aclError share_create(device_cache *dc, cache_block *b, share_record **out)
{
    share_record *rec = calloc(1, sizeof *rec);
    if (!rec)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    random_bytes(rec->token, sizeof rec->token);
    rec->device = dc->device;
    rec->block = b;
    rec->alive = true;
    rec->size = b->size;
    aclError rc = ACL_SUCCESS;
    if (b->es) {
        expandable_segment *es = b->es;
        size_t first = (b->ptr - es->base) / es->page_size;
        size_t last = (b->ptr + b->size - 1 - es->base) / es->page_size;
        rec->kind = 'e';
        rec->page_size = es->page_size;
        rec->offset = b->ptr - (es->base + first * es->page_size);
        rec->entries = calloc(last - first + 1, sizeof *rec->entries);
        if (!rec->entries)
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        for (size_t i = first; i <= last && rc == ACL_SUCCESS; i++) {
            rc = share_export(false, (uintptr_t)es->handles[i], &rec->entries[rec->count]);
            if (rc == ACL_SUCCESS)
                rec->count++;
        }
    } else {
        cache_block *head = b;
        while (head->prev)
            head = head->prev;
        rec->kind = 'c';
        rec->offset = b->ptr - head->ptr;
        rec->entries = calloc(1, sizeof *rec->entries);
        if (!rec->entries)
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        else if ((rc = share_export(true, head->ptr, &rec->entries[0])) == ACL_SUCCESS)
            rec->count = 1;
    }
    rec->next = ipc.shares;
    ipc.shares = rec;
    if (rc != ACL_SUCCESS) {
        share_delete(rec);
        return rc;
    }
    *out = rec;
    return ACL_SUCCESS;
}

aclError ipc_share(void *ptr, void *buf, size_t cap, size_t *len)
{
    if (!ptr || !len)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    int32_t dev = va_device_of((uintptr_t)ptr);
    device_cache *dc = dev >= 0 && dev < NPU_MAX_DEVICES && device_valid(dev) ? cache_device(dev) : NULL;
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&ipc.lock);
    rc = ensure_server_locked();
    pthread_mutex_unlock(&ipc.lock);
    if (rc != ACL_SUCCESS)
        return rc;
    cache_lock_acquire(&dc->lock);
    cache_block *b = ptr_map_get(&dc->allocated_blocks, (uintptr_t)ptr);
    pthread_mutex_lock(&ipc.lock);
    share_record *rec = NULL;
    if (!b) {
        rc = ACL_ERROR_INVALID_PARAM; /* not a live block of the caching allocator */
    } else if (b->shared) {
        for (rec = ipc.shares; rec && !(rec->block == b && rec->alive); rec = rec->next) {
        }
        rc = rec ? ACL_SUCCESS : ACL_ERROR_RT_INTERNAL_ERROR;
    } else if ((rc = share_create(dc, b, &rec)) == ACL_SUCCESS) {
        b->shared = true;
    }
    if (rc == ACL_SUCCESS) {
        size_t values = rec->kind == 'e' ? rec->count : 0;
        *len = sizeof(share_desc) + values * sizeof(uint64_t);
        if (!buf || cap < *len) {
            rc = ACL_ERROR_INVALID_PARAM;
        } else {
            share_desc d;
            memset(&d, 0, sizeof d);
            memcpy(d.magic, "NPUS", 4);
            d.version = 1;
            d.kind = rec->kind;
            d.pid = self_pid();
            d.secret = ipc.secret;
            d.device = rec->device;
            d.count = (uint32_t)rec->count;
            memcpy(d.token, rec->token, 16);
            d.offset = rec->offset;
            d.size = rec->size;
            d.page_size = rec->page_size;
            if (rec->kind == 'c')
                memcpy(d.key_token, rec->entries[0]->token, 16);
            memcpy(buf, &d, sizeof d);
            for (size_t i = 0; i < values; i++)
                memcpy((char *)buf + sizeof d + i * sizeof(uint64_t), &rec->entries[i]->value, sizeof(uint64_t));
        }
    }
    pthread_mutex_unlock(&ipc.lock);
    cache_lock_release(&dc->lock);
    return rc;
}

static aclError parse_desc(const void *desc, size_t len, share_desc *d)
{
    if (!desc || len < sizeof *d)
        return ACL_ERROR_INVALID_PARAM;
    memcpy(d, desc, sizeof *d);
    if (memcmp(d->magic, "NPUS", 4) != 0 || d->version != 1 || (d->kind != 'c' && d->kind != 'e') ||
        d->pid <= 0 || d->pid >= (1 << IPC_PID_BITS) || d->secret >= (1u << IPC_SECRET_BITS))
        return ACL_ERROR_INVALID_PARAM;
    if (d->kind == 'e' ? (d->count == 0 || d->count > MAX_SHARE_PAGES || d->page_size == 0 ||
                          d->page_size % VMM_GRANULARITY != 0 || d->page_size > ((uint64_t)1 << 40) ||
                          len != sizeof *d + (size_t)d->count * sizeof(uint64_t) ||
                          d->offset >= d->count * d->page_size || d->size > d->count * d->page_size - d->offset)
                       : (d->count != 1 || len != sizeof *d))
        return ACL_ERROR_INVALID_PARAM;
    return ACL_SUCCESS;
}

aclError ipc_share_describe(const void *desc, size_t len, char *kind, int32_t *pid, int32_t *device, uint64_t *size)
{
    share_desc d;
    aclError rc = parse_desc(desc, len, &d);
    if (rc == ACL_SUCCESS) {
        *kind = d.kind;
        *pid = d.pid;
        *device = d.device;
        *size = d.size;
    }
    return rc;
}

/* The session to an exporter (one more reference), connecting if there is none. */
static aclError session_get(int32_t pid, uint32_t secret, session **out)
{
    pthread_mutex_lock(&ipc.lock);
    for (session *s = ipc.sessions; s; s = s->next) {
        if (s->pid == pid && s->secret == secret && !s->dead) {
            s->refs++;
            *out = s;
            pthread_mutex_unlock(&ipc.lock);
            return ACL_SUCCESS;
        }
    }
    pthread_mutex_unlock(&ipc.lock);
    int fd;
    aclError rc = connect_exporter(pid, secret, &fd);
    if (rc != ACL_SUCCESS)
        return rc;
    session *s = calloc(1, sizeof *s);
    if (!s) {
        close(fd);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    s->pid = pid;
    s->secret = secret;
    s->fd = fd;
    s->refs = 1;
    s->next_id = 1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_mutex_lock(&ipc.lock);
    for (session *o = ipc.sessions; o; o = o->next) {
        if (o->pid == pid && o->secret == secret && !o->dead) { /* another thread connected meanwhile */
            o->refs++;
            pthread_mutex_unlock(&ipc.lock);
            close(fd);
            pthread_mutex_destroy(&s->lock);
            free(s);
            *out = o;
            return ACL_SUCCESS;
        }
    }
    s->next = ipc.sessions;
    ipc.sessions = s;
    pthread_mutex_unlock(&ipc.lock);
    *out = s;
    return ACL_SUCCESS;
}

static void session_put(session *s)
{
    pthread_mutex_lock(&ipc.lock);
    bool last = --s->refs == 0;
    if (last) {
        for (session **link = &ipc.sessions; *link; link = &(*link)->next) {
            if (*link == s) {
                *link = s->next;
                break;
            }
        }
    }
    pthread_mutex_unlock(&ipc.lock);
    if (last) {
        close(s->fd); /* the exporter drops whatever pins this connection still held */
        pthread_mutex_destroy(&s->lock);
        free(s);
    }
}

static aclError session_request(session *s, uint16_t op, const uint8_t token[16])
{
    ipc_reply rp;
    pthread_mutex_lock(&s->lock);
    aclError rc = session_roundtrip(s, op, 0, token, &rp, NULL);
    pthread_mutex_unlock(&s->lock);
    return rc == ACL_SUCCESS ? rp.status : rc;
}

static void unmap_open(void *base, size_t count, size_t page, const uint64_t *handles, size_t mapped)
{
    for (size_t i = 0; i < mapped; i++)
        vmm_unmap_private((char *)base + i * page);
    if (base)
        vmm_release_private(base);
    for (size_t i = 0; i < count; i++)
        if (handles[i])
            aclrtFreePhysical((aclrtDrvMemHandle)(uintptr_t)handles[i]);
}

/* Leaves accessible only the host pages of [base, base + total) that cover the block at
 * [offset, offset + size): the rest of the segment or pages, other blocks of the owner, turns
 * back into reserved, inaccessible memory (vmm_confine_private). */
static aclError confine_to_block(void *base, size_t total, uint64_t offset, uint64_t size)
{
    long ps = sysconf(_SC_PAGESIZE);
    uint64_t hp = ps > 0 ? (uint64_t)ps : 4096;
    uint64_t lo = offset / hp * hp, hi = (offset + size + hp - 1) / hp * hp;
    if (hi > total)
        hi = total;
    return vmm_confine_private(base, (size_t)lo, (size_t)hi);
}

/* The open of a handle for a device in this process, or NULL (ipc.lock held). */
static open_share *open_find(const share_desc *d, int32_t device)
{
    for (open_share *o = ipc.opens; o; o = o->next)
        if (o->exporter == d->pid && o->device == device && memcmp(o->token, d->token, 16) == 0)
            return o;
    return NULL;
}

aclError ipc_open_shared(const void *desc, size_t len, int32_t device, void **ptr)
{
    share_desc d;
    aclError rc = parse_desc(desc, len, &d);
    if (rc != ACL_SUCCESS || !ptr)
        return ACL_ERROR_INVALID_PARAM;
    peer_version = 0;
    if ((rc = runtime_ensure_init()) != ACL_SUCCESS)
        return rc;
    int32_t target = device < 0 ? d.device : device;
    if (!device_valid(target))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if (d.pid == self_pid())
        return ACL_ERROR_RT_DRV_INTERNAL_ERROR; /* the owner has the block already */
    pthread_mutex_lock(&ipc.lock);
    open_share *same = open_find(&d, target);
    if (same) {
        same->refs++;
        *ptr = same->ptr;
    }
    pthread_mutex_unlock(&ipc.lock);
    if (same)
        return ACL_SUCCESS;

    session *s;
    if ((rc = session_get(d.pid, d.secret, &s)) != ACL_SUCCESS)
        return rc;
    rc = session_request(s, IPC_OP_OPEN, d.token);
    if (rc != ACL_SUCCESS && session_dead(s)) {
        /* The owner hung up under this request: it drops a connection of 16 failed lookups and no
         * success (another thread's, which shares it), or it exited.  Once more on a connection of
         * its own; an owner that exited refuses it as before. */
        session_put(s);
        if ((rc = session_get(d.pid, d.secret, &s)) != ACL_SUCCESS)
            return rc;
        rc = session_request(s, IPC_OP_OPEN, d.token);
    }
    if (rc != ACL_SUCCESS) {
        session_put(s);
        return rc;
    }
    size_t count = d.count, page = 0, mapped = 0;
    uint64_t *handles = calloc(count, sizeof *handles);
    open_share *o = calloc(1, sizeof *o);
    void *base = NULL;
    if (!handles || !o)
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_mutex_lock(&s->lock); /* page imports travel on the pinned connection */
    if (s->dead) /* since our OPEN */
        rc = ACL_ERROR_RT_IPC_ERROR;
    for (size_t i = 0; i < count && rc == ACL_SUCCESS; i++) {
        import_spec sp = {.exporter = d.pid, .secret = d.secret, .device = target, .s = s};
        if (d.kind == 'e') {
            memcpy(&sp.value, (const char *)desc + sizeof d + i * sizeof(uint64_t), sizeof sp.value);
        } else {
            sp.is_key = true;
            sp.key_device = d.device;
            memcpy(sp.token, d.key_token, 16);
        }
        size_t size = 0;
        rc = import_handle(&sp, &handles[i], &size);
        if (rc == ACL_SUCCESS && d.kind == 'e' && size != d.page_size)
            rc = ACL_ERROR_RT_IPC_ERROR;
        page = size;
    }
    pthread_mutex_unlock(&s->lock);
    if (rc == ACL_SUCCESS && d.kind == 'c' && (d.offset >= page || d.size > page - d.offset))
        rc = ACL_ERROR_RT_IPC_ERROR;
    if (rc == ACL_SUCCESS) /* the runtime's own range, as for aclrtIpcMemImportByKey */
        rc = vmm_reserve_private(target, count * page, &base);
    for (; rc == ACL_SUCCESS && mapped < count; mapped++)
        if ((rc = vmm_map_private((char *)base + mapped * page, page, (aclrtDrvMemHandle)(uintptr_t)handles[mapped])) !=
            ACL_SUCCESS)
            break;
    if (rc == ACL_SUCCESS)
        rc = confine_to_block(base, count * page, d.offset, d.size);
    if (rc == ACL_SUCCESS) /* (o may be NULL otherwise) */
        *o = (open_share){.exporter = d.pid, .device = target, .s = s, .base = base,
                          .ptr = (char *)base + d.offset, .count = count, .page_size = page,
                          .handles = handles, .refs = 1};
    if (rc == ACL_SUCCESS)
        memcpy(o->token, d.token, 16);
    /* Another thread opened the same handle meanwhile: its pointer, so that one handle has one pointer
     * in a process (ours is undone below, as a failed open is).  The look and the listing are one
     * section: two threads that both found none listed two pointers. */
    pthread_mutex_lock(&ipc.lock);
    same = rc == ACL_SUCCESS ? open_find(&d, target) : NULL;
    if (same) {
        same->refs++;
        *ptr = same->ptr;
    } else if (rc == ACL_SUCCESS) {
        o->next = ipc.opens;
        ipc.opens = o;
    }
    pthread_mutex_unlock(&ipc.lock);
    if (rc != ACL_SUCCESS || same) {
        if (handles)
            unmap_open(base, count, page, handles, mapped);
        (void)session_request(s, IPC_OP_CLOSE, d.token);
        session_put(s);
        free(handles);
        free(o);
        return rc;
    }
    *ptr = o->ptr;
    return ACL_SUCCESS;
}

aclError ipc_close_shared(void *ptr)
{
    if (!ptr)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&ipc.lock);
    open_share *o = NULL;
    bool last = false; /* decided under the lock: another close may free `o` once it is out */
    for (open_share **link = &ipc.opens; *link; link = &(*link)->next) {
        if ((*link)->ptr == ptr) {
            o = *link;
            if ((last = --o->refs == 0))
                *link = o->next;
            break;
        }
    }
    pthread_mutex_unlock(&ipc.lock);
    if (!o)
        return ACL_ERROR_INVALID_PARAM;
    if (last) {
        unmap_open(o->base, o->count, o->page_size, o->handles, o->count);
        (void)session_request(o->s, IPC_OP_CLOSE, o->token);
        session_put(o->s);
        free(o->handles);
        free(o);
    }
    return ACL_SUCCESS;
}

/* ---- introspection ---- */

void ipc_get_counts(ipc_counts *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&ipc.lock);
    for (export_entry *e = ipc.exports; e; e = e->next)
        out->exports++;
    for (import_entry *i = ipc.imports; i; i = i->next)
        out->imports += !i->pending;
    for (key_import *k = ipc.key_imports; k; k = k->next)
        out->key_imports++;
    for (share_record *r = ipc.shares; r; r = r->next)
        out->shares++;
    for (open_share *o = ipc.opens; o; o = o->next)
        out->opens++;
    for (session *s = ipc.sessions; s; s = s->next)
        out->sessions++;
    out->server_running = ipc.server_running;
    out->secret = ipc.secret;
    pthread_mutex_unlock(&ipc.lock);
    out->clients = atomic_load(&ipc.client_count);
    out->failed = atomic_load(&lookups_failed);
    out->refused = atomic_load(&lookups_refused);
    out->pins = atomic_load(&ipc.pin_count);
}

/* ---- lifetime ---- */

/* Frees every table entry (at shutdown and in a fork child). */
static void forget_all(void)
{
    nknown = 0;
    while (ipc.exports)
        export_remove(ipc.exports);
    while (ipc.imports) {
        import_entry *i = ipc.imports;
        ipc.imports = i->next;
        free(i);
    }
    while (ipc.key_imports) {
        key_import *k = ipc.key_imports;
        ipc.key_imports = k->next;
        free(k);
    }
    while (ipc.opens) {
        open_share *o = ipc.opens;
        ipc.opens = o->next;
        free(o->handles);
        free(o);
    }
    while (ipc.sessions) {
        session *s = ipc.sessions;
        ipc.sessions = s->next;
        close(s->fd);
        free(s);
    }
    while (ipc.shares) {
        share_record *r = ipc.shares;
        ipc.shares = r->next;
        free(r->entries);
        free(r);
    }
}

void ipc_atfork_prepare(void) { pthread_mutex_lock(&ipc.lock); }
void ipc_atfork_parent(void) { pthread_mutex_unlock(&ipc.lock); }

void ipc_atfork_child(void)
{
    /* The child has no server thread and none of the parent's device memory: start empty.
     * Descriptors are copies; closing them here affects nobody else. */
    pthread_mutex_unlock(&ipc.lock); /* taken by this thread in prepare */
    pthread_cond_init(&ipc.cond, NULL); /* its waiters were threads that do not exist here */
    ipc.pid = (int32_t)getpid();
    if (ipc.server_running) {
        close(ipc.listen_fd);
        close(ipc.wake_fd);
        ipc.listen_fd = ipc.wake_fd = -1;
        ipc.server_running = false;
    }
    /* The child's copy of the spare.  Forked while the server thread had it out (between taking
     * it and putting it back), the child reads -1 and may keep one /dev/null descriptor; it
     * never closes a descriptor that is not the spare. */
    int spare = atomic_exchange(&spare_fd, -1);
    if (spare >= 0)
        close(spare);
    for (size_t i = 0; i < nclients; i++) {
        close(clients[i].fd);
        free(clients[i].pins);
    }
    free(clients);
    clients = NULL;
    nclients = clients_cap = 0;
    forget_all();
    atomic_store(&ipc.client_count, 0);
    atomic_store(&ipc.pin_count, 0);
    memset(rates, 0, sizeof rates);
    atomic_store(&lookups_failed, 0);
    atomic_store(&lookups_refused, 0);
    ipc.secret = 0;
}

void ipc_shutdown(void)
{
    pthread_mutex_lock(&ipc.lock);
    bool running = ipc.server_running;
    ipc.server_running = false;
    pthread_mutex_unlock(&ipc.lock);
    if (running) {
        uint64_t one = 1;
        if (write(ipc.wake_fd, &one, sizeof one) < 0) {
        }
        pthread_join(ipc.thread, NULL);
        close(ipc.listen_fd);
        close(ipc.wake_fd);
        ipc.listen_fd = ipc.wake_fd = -1;
        int spare = atomic_exchange(&spare_fd, -1);
        if (spare >= 0)
            close(spare);
    }
    /* Pins held by other processes go: pending frees complete. */
    while (nclients)
        client_drop(nclients - 1);
    free(clients);
    clients = NULL;
    clients_cap = 0;
    memset(rates, 0, sizeof rates);
    /* Live shares: their blocks stop being shared. */
    for (;;) {
        pthread_mutex_lock(&ipc.lock);
        share_record *rec = ipc.shares;
        int32_t dev = rec ? rec->device : -1;
        pthread_mutex_unlock(&ipc.lock);
        if (!rec)
            break;
        device_cache *dc = cache_device(dev);
        if (dc)
            cache_lock_acquire(&dc->lock);
        pthread_mutex_lock(&ipc.lock);
        if (ipc.shares == rec) {
            if (rec->alive)
                rec->block->shared = false;
            share_delete(rec);
        }
        pthread_mutex_unlock(&ipc.lock);
        if (dc)
            cache_lock_release(&dc->lock);
    }
    pthread_mutex_lock(&ipc.lock);
    forget_all(); /* vmm_shutdown releases the imported handles and mappings */
    ipc.secret = 0;
    pthread_mutex_unlock(&ipc.lock);
}
