/*
 * ipc.h - cross-process sharing of device memory: CANN's shareable handles
 * (aclrtMemExportToShareableHandle & co.), IPC keys (aclrtIpcMem*), and the sharing of
 * caching-allocator blocks (npualloc.share / open_shared / close_shared).  docs/sharing.md has
 * the user's view; this header has the design.
 *
 * ---- What is shared ----
 * Device memory is a memory file (memfd) per physical handle (host.h).  Sharing hands the
 * importer a descriptor of that file; the importer maps it into its own reserved ranges.
 * Nothing is copied, and the kernel reference-counts the file: the memory lives while any
 * process holds a descriptor, a handle or a mapping of it.  So the exporter may exit first,
 * and an importer that crashes takes only its own references with it.  The exporter seals the
 * file's size (F_SEAL_SHRINK | F_SEAL_GROW) before the first descriptor leaves the process, and
 * the importer refuses a file without the seal: no process can truncate the memory under the
 * others (which would fault them).
 *
 * ---- Shareable handle value (uint64) ----
 *   bits 63..40  24 random bits  \  56 random bits (getrandom), drawn per export, unique
 *   bits 39..32  the exporting device id (CANN's layout: share_devid << 32)
 *   bits 31..0   32 random bits  /  in the process (and 0 is never a value)
 * Nothing in a value says which process exported it: the only secret a guesser has to find
 * is the whole 56 bits (2^55 guesses on average per live value; at the 1000 failed lookups a
 * second that each exporter answers a peer process, and even at the ~10^5 a second one core
 * could ask without any limit, that is millennia).  An earlier layout put the exporter's pid
 * and its server's name secret in the low 32 bits; both are public (/proc/net/unix lists the
 * socket names), which left 24 secret bits: found by brute force within hours.
 *
 * ---- Finding the exporter of a value ----
 * The importer asks the npualloc servers it can reach until one knows the value: first the
 * servers that answered this process before (a small cache, most recent first), then every
 * other listening socket named "npualloc-ipc-*" in /proc/net/unix (abstract sockets live in the
 * network namespace, and /proc/net/unix lists exactly those of the importer's namespace: the
 * ones it can connect to).  Each server is checked before the value is sent: SO_PEERCRED must
 * name the pid in the socket's name and a user the importer accepts (so a value is only ever
 * shown to processes of accepted users, which could read this process's memory anyway).
 * Servers are asked at the same time, up to 32 at once, over non-blocking connections and one
 * poll(): the cached ones alone for up to 10 ms (until they all answered), then everybody.  A
 * Unix connect completes into the listener's queue whether or not anybody ever accepts, so a
 * listener that never answers (a stopped process, a squatter) can only be waited for: each
 * server gets a search window of a tenth of NPUALLOC_IPC_TIMEOUT_MS, after which it counts as
 * busy.  It delays nothing when another server knows the value.  A server that does not know
 * the value answers 107017; the first other answer is final.  No server knows it: 107017
 * (507899 when servers of users not accepted were skipped: the value may be theirs; 507022 when
 * a server refused as busy or stayed silent for its window: it may have been the owner; also
 * when this process had no descriptor to ask one).
 * The cost is one connect and one round trip per server asked; the cache makes the usual
 * case (several imports from one exporter) a single round trip.
 *
 * ---- Refusing guessers ----
 * A server counts the failed lookups of every peer process (by SO_PEERCRED pid, in a table of
 * RATE_SLOTS processes) and answers at most 1000 of them a second per process: beyond that,
 * lookups of that process are refused unanswered (507022) until its second is over.  The
 * server thread never sleeps, so a flood from one process delays the requests of others by
 * at most the time to refuse the requests queued before them (microseconds each).  A
 * connection is also dropped after 16 failed lookups.  Lookups compare 64-bit values, and
 * 128-bit tokens in constant time; the time a lookup takes does not depend on how close a
 * guess is.  (An attacker with many processes gets 1000 a second for each: the limiter is a
 * second line; the 56 bits are the first.)
 *
 * ---- IPC key (string, at most 64 characters + NUL) ----
 *   "npualloc-k1-<pid>-<secret, 3 hex>-<device>-<token, 32 hex>"   (128-bit random token)
 * A key names its exporter's server directly (pid and name secret, both public); its 128-bit
 * token is the secret.
 *
 * ---- Transport ----
 * The exporter runs one server thread, started on its first export, listening on the
 * abstract-namespace Unix socket "\0npualloc-ipc-<pid>-<secret, 3 hex>" (SOCK_SEQPACKET; no
 * file on disk; the 10-bit name secret only lets a new server step around a squatted name).
 * An importer connects and checks, with SO_PEERCRED, that the listener really
 * is process <pid> of an accepted user (nobody else can impersonate the exporter).  The
 * exporter reads the importer's pid and uid from SO_PEERCRED, which the kernel fills in at
 * connect time, and which process it is (SO_PEERPIDFD, also recorded at connect time, and its
 * start time from /proc) when it accepts the connection: the importer never states who it is
 * (the request's `claimed_pid` field is only informational and is never read), so it cannot be
 * talked around.  It then checks:
 *   - the value: it must name a live export of this process (its owner has not freed it);
 *   - the uid: the exporter's own, or one listed in NPUALLOC_IPC_ALLOW_UIDS ("1001,1002");
 *   - the pid whitelist (unless exported with DISABLE_PID_VALIDATION): the pid must have been
 *     set, and the process must be the one that had that pid when it was set, so a recycled
 *     pid does not inherit the permission.  Processes are told apart by the inode number of
 *     their pidfd where pidfs exists (Linux 6.9+: unique per process on 64-bit; the pidfd is
 *     opened, read and closed, so no descriptor is kept per listed pid), else by start time
 *     in clock ticks like CANN's time check (two processes that get one pid within one 10 ms
 *     tick look alike there).  A pid nobody has when it is set admits nobody;
 * and answers with the file's descriptor (SCM_RIGHTS), its size, page kind and device.
 * The server keeps a spare descriptor (/dev/null): when its process has none free, accept()
 * fails and the connection would stay queued, the listener polling ready for ever; the server
 * then closes the spare, accepts, answers 507022 unread, closes and takes the spare back.  With
 * no spare to give (another thread took the slot) the listener rests 100 ms between attempts.
 *
 * Messages (little-endian, fixed size; one request or reply per SEQPACKET message):
 *   request  { u32 magic 'NPUI' (0x4955504e); u16 version 2; u16 op; i32 claimed_pid (ignored);
 *              u32 id; u64 value; u8 token[16] }                                      40 bytes
 *   reply    { u32 magic; u16 version 2; u16 op; u32 id; i32 status (aclError); i32 device;
 *              u32 kind; u64 size }                                                   32 bytes,
 *              plus one descriptor when status is 0 and the op imports
 *   ops: 1 IMPORT (value = shareable handle), 2 IMPORT_KEY (token = key token, value = its
 *        device), 3 OPEN (token = share token: pin), 4 CLOSE (token: unpin), 5 PROBE (value:
 *        status 0 if it is a live exported value of this process; set-pid uses it to tell a
 *        value of another process, 507899, from an unknown one, 107017), 6 CANCEL (value = the
 *        id of the OPEN just before it: undo its pin, if it granted one; no reply)
 *   status 507022 on a lookup: refused unanswered (the peer's failed lookups are over budget)
 * A connection that sends anything else is dropped, as is one with 16 failed lookups.
 *
 * ---- Request ids (version 2) ----
 * A reply echoes the id of its request; the server answers the requests of a connection in
 * order.  An opener keeps one connection per owner (a session) and sends one request at a time
 * on it, with ids 1, 2, 3... (0 is never used); when a request goes unanswered for
 * NPUALLOC_IPC_TIMEOUT_MS (a stopped or overloaded owner), its reply may still come: the next
 * request on the session reads and discards every reply whose id is not its own (closing any
 * descriptor one carries), so a late reply never answers the wrong request, and the session
 * stays usable.  Id 0 in a reply marks a request the server refused without reading it (out of
 * descriptors, or another protocol version): it answers whatever the opener waits for.
 * The only request that leaves state at the owner is OPEN (a pin).  Invariants that keep a late
 * grant from leaking a pin:
 *   - after an OPEN that timed out, the opener sends CANCEL of its id before any other request
 *     on the session (at once, or before the next request if the socket is full; a session
 *     that owes a CANCEL sends nothing else);
 *   - so on the wire CANCEL n comes right after OPEN n, and the server, which serves a
 *     connection's messages in order, only has to remember whether the last request of each
 *     connection was an OPEN that pinned (and which share): CANCEL n drops that pin, and does
 *     nothing if OPEN n failed or was not the last request;
 *   - CLOSE and the imports need no cancel: a CLOSE that timed out is still served in order
 *     (the opener has already forgotten the open), and an import grants only a descriptor,
 *     which the opener closes when it reads the late reply (until then it sits in the socket,
 *     and goes with the session when it is closed).
 * Deaths: an opener that dies at any point closes its socket, and the server drops every pin of
 * the connection (granted, cancelled or not); an owner that dies takes its pins with it, and
 * the opener's session sees the hang-up and is given up (new opens connect anew).  A session
 * is also given up when a reply breaks the protocol (wrong size, magic, version or id).
 *
 * ---- Versions ----
 * magic and version open every request and reply, in every version.  A server answers a
 * request of another version with status 507022 and id 0 (in the layout of version 1 to a
 * version-1 request, which its sender can read) and hangs up; an opener that gets a reply of
 * another version (a 24-byte reply is version 1's, which had no version field) fails with
 * 507022 and records the owner's version for the message (ipc_last_peer_version).  A version-1
 * server hangs up on a version-2 request without a reply: that reads as an owner that exited.
 *
 * ---- Error codes (CANN's, from the driver paths noted in npu-acl-runtime.md B3) ----
 *   ACL_ERROR_INVALID_PARAM 100000   NULL pointer, handle type not NONE, pid count 0
 *   ACL_ERROR_RT_PARAM_INVALID 107000  export flags > 1, IPC key of memory that is not the start
 *                                    of an aclrtMalloc allocation, size larger than it
 *   ACL_ERROR_RT_INVALID_DEVICEID 107001  import for a device that does not exist
 *   ACL_ERROR_RT_INVALID_HANDLE 107017  unknown or forged value/key, or the exporter freed it
 *                                    or exited ("Share handle doesn't exist", -EFAULT)
 *   ACL_ERROR_RT_DRV_INTERNAL_ERROR 507899  not on the whitelist or not an accepted user
 *                                    (-EACCES), the exporter importing its own value ("Export
 *                                    process can not import"), set-pid by a process that is not
 *                                    the exporter (-EACCES), a second export of one handle
 *                                    ("Blk has been shared", -EINVAL: CANN allows one value per
 *                                    handle), exporting an imported handle
 *   ACL_ERROR_RT_RESOURCE_ALLOC_FAIL 207005  export of memory created past the descriptor budget
 *                                    when the reopen through /proc/self/map_files is refused
 *                                    (no CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE: export_create
 *                                    tries it); the exporter out of descriptors at an import
 *   ACL_ERROR_RT_NO_PERMISSION 207006  set-pid after a DISABLE_PID_VALIDATION export
 *   ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000  import for another device without peer access
 *                                    between the two (the code of a copy between such devices),
 *                                    export of host-resident physical memory
 *   ACL_ERROR_RT_IPC_ERROR 507022     the exporter broke the protocol, did not answer in time
 *                                    (NPUALLOC_IPC_TIMEOUT_MS, default 10000) or had no free
 *                                    descriptor to take the connection
 *
 * ---- Importing ----
 * An imported handle is a normal physical handle of the importing process, charged to no
 * device (the exporter's device carries the memory), belonging to the device it was imported
 * for.  Importing the same value for the same device again returns the same handle with one
 * more reference; aclrtFreePhysical drops one.  Importing for another device than the
 * exporting one requires peer access between the two devices in the importing process.
 *
 * ---- Sharing caching-allocator blocks (npualloc.share) ----
 * share(ptr) creates a share record for a live block: a plain segment is shared whole through
 * an internal IPC-key export of its aclrtMalloc memory (the descriptor carries the block's
 * offset, as torch's 'c' handles do); an expandable segment's block through one shareable
 * value per physical page it spans ('e').  The descriptor is a small byte string.
 * open_shared(desc) keeps one connection per exporter (a session), sends OPEN (the exporter
 * pins the block: cache_block.share_pins), imports the pages over that same connection and maps
 * them into a fresh reserved range, then puts inaccessible memory back over everything but the
 * host pages covering the block (the opener's process still holds the descriptors of the whole
 * segment or pages: a file descriptor cannot be narrowed; docs/sharing.md).  The exporter serves share-created exports only to
 * connections that hold a pin on a share that contains them.  close_shared(ptr) unmaps and sends
 * CLOSE; a process that dies closes its session, and the exporter's server, seeing the hang-up,
 * drops every pin of that connection.  A block freed by its owner while pinned stays out of the
 * owner's pools (a pending free, like one waiting for stream events) until the last pin goes;
 * its expandable pages therefore stay mapped.  A freed block can no longer be opened.
 *
 * ---- Fork, threads, shutdown ----
 * All entry points are thread-safe.  The child of fork() starts with no exports, imports,
 * shares or server (device memory is not inherited); it may import from its parent.
 * Lock order: a device cache's lock, then the ipc lock, then the vmm lock.
 */
#ifndef NPUALLOC_IPC_H
#define NPUALLOC_IPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acl_rt.h"

#define IPC_KEY_LEN 65 /* CANN's key buffer: 64 characters and the NUL */

/* Shareable-handle value layout: the device in bits 39..32, the other 56 bits random. */
#define IPC_VALUE_DEVICE_SHIFT 32
#define IPC_VALUE_DEVICE_MASK ((uint64_t)0xFF << IPC_VALUE_DEVICE_SHIFT)
/* Server names and keys: the exporter's pid (pid_max is at most 2^22) and a 10-bit name secret. */
#define IPC_PID_BITS 22
#define IPC_SECRET_BITS 10

static inline int32_t ipc_value_device(uint64_t v) { return (int32_t)((v >> IPC_VALUE_DEVICE_SHIFT) & 0xFF); }

/* Wire format (see above). */
#define IPC_MAGIC 0x4955504eu /* "NPUI" */
#define IPC_VERSION 2 /* 2: request ids and CANCEL */
#define IPC_V1_REPLY_SIZE 24 /* version 1's reply {magic, status, device, kind, size}: no version field */
enum {
    IPC_OP_IMPORT = 1,
    IPC_OP_IMPORT_KEY = 2,
    IPC_OP_OPEN = 3,
    IPC_OP_CLOSE = 4,
    IPC_OP_PROBE = 5,
    IPC_OP_CANCEL = 6,
};

typedef struct ipc_request {
    uint32_t magic;
    uint16_t version;
    uint16_t op;
    int32_t claimed_pid; /* what the sender says its pid is: never read by the exporter */
    uint32_t id;         /* echoed in the reply */
    uint64_t value;
    uint8_t token[16];
} ipc_request;

typedef struct ipc_reply {
    uint32_t magic;
    uint16_t version;
    uint16_t op; /* the request's */
    uint32_t id; /* the request's; 0: a request refused unread */
    int32_t status;
    int32_t device;
    uint32_t kind;
    uint64_t size;
} ipc_reply;

/* The abstract socket name of an exporter's server (without the leading NUL); returns its length. */
int ipc_server_name(int32_t pid, uint32_t secret, char *buf, size_t len);

/* ---- caching-allocator blocks (npualloc.share) ---- */
/* Writes the share descriptor of the live block at `ptr` into buf (cap bytes); *len receives
 * its size (also when cap is too small: ACL_ERROR_INVALID_PARAM then).  Errors: not a live
 * caching-allocator block -> ACL_ERROR_INVALID_PARAM; transport trouble -> 507022. */
aclError ipc_share(void *ptr, void *buf, size_t cap, size_t *len);
/* Maps the block of a descriptor; `device` -1 means the exporting device. */
aclError ipc_open_shared(const void *desc, size_t len, int32_t device, void **ptr);
/* Unmaps memory from ipc_open_shared (the last close of a pointer opened several times). */
aclError ipc_close_shared(void *ptr);
/* The protocol version of the owner whose reply made this thread's last ipc_open_shared fail
 * (0: none did; see Versions above). */
uint16_t ipc_last_peer_version(void);
/* What a descriptor holds (for display): kind 'c' or 'e', the exporter, device and size. */
aclError ipc_share_describe(const void *desc, size_t len, char *kind, int32_t *pid, int32_t *device,
                            uint64_t *size);

/* ---- introspection (tests, leak checks) ---- */
typedef struct ipc_counts {
    size_t exports;      /* live export entries (values and keys) */
    size_t imports;      /* imported handles this process holds through the import table */
    size_t key_imports;  /* IPC keys mapped here */
    size_t shares;       /* share records (owner side) */
    size_t opens;        /* open_shared mappings (importer side) */
    size_t sessions;     /* connections to exporters kept for opens */
    size_t clients;      /* connections the server holds */
    size_t pins;         /* pins held by the server's clients */
    uint64_t failed;     /* lookups the server answered with a failure (since the runtime started) */
    uint64_t refused;    /* lookups it refused unanswered: the peer was over its budget */
    bool server_running;
    uint32_t secret;     /* the running server's secret */
} ipc_counts;
void ipc_get_counts(ipc_counts *out);

/* ---- lifetime (runtime.c) ---- */
/* False (with a message naming the variable and its value) when NPUALLOC_IPC_TIMEOUT_MS is set
 * and malformed; the runtime then refuses to start. */
bool ipc_check_env(char *err, size_t errlen);

void ipc_atfork_prepare(void);
void ipc_atfork_parent(void);
void ipc_atfork_child(void);
/* Stops the server, drops every pin, export, import and session (before the caches go). */
void ipc_shutdown(void);

#endif
