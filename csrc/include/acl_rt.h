/*
 * acl_rt.h - the AscendCL runtime memory API (aclrt*), implemented by npualloc on host memory.
 *
 * Names, prototypes, enum values and error codes follow CANN's acl_base.h / acl_rt.h /
 * rt_error_codes.h, so a C program written against the ACL memory API compiles and links
 * against libnpualloc unchanged.  Only the subset npualloc implements is declared here.
 */
#ifndef NPUALLOC_ACL_RT_H
#define NPUALLOC_ACL_RT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int aclError;
typedef void *aclrtContext;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void *aclrtDrvMemHandle;
typedef void (*aclrtCallback)(void *userData);

/* ---- error codes (acl_base.h, rt_error_codes.h) ---- */
#define ACL_SUCCESS 0
#define ACL_ERROR_NONE 0
#define ACL_RT_SUCCESS 0

#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_REPEAT_FINALIZE 100037 /* aclFinalize without a matching aclInit */
#define ACL_ERROR_DUMP_NOT_RUN 100045
/* acl_base.h declares these four; CANN's current runtime returns the 1070xx codes below
 * instead (ACL passes runtime codes through), and so does npualloc. */
#define ACL_ERROR_REPEAT_SUBSCRIBE 100033
#define ACL_ERROR_STREAM_NOT_SUBSCRIBE 100034
#define ACL_ERROR_THREAD_NOT_SUBSCRIBE 100035
#define ACL_ERROR_WAIT_CALLBACK_TIMEOUT 100036
#define ACL_ERROR_BAD_ALLOC 200000
#define ACL_ERROR_API_NOT_SUPPORT 200001
#define ACL_ERROR_INVALID_DEVICE 200002
#define ACL_ERROR_MEMORY_ADDRESS_UNALIGNED 200003
#define ACL_ERROR_RESOURCE_NOT_MATCH 200004
#define ACL_ERROR_INVALID_RESOURCE_HANDLE 200005
#define ACL_ERROR_FEATURE_UNSUPPORTED 200006
#define ACL_ERROR_PROF_MODULES_UNSUPPORTED 200007
#define ACL_ERROR_STORAGE_OVER_LIMIT 300000
#define ACL_ERROR_INTERNAL_ERROR 500000
#define ACL_ERROR_FAILURE 500001
#define ACL_ERROR_GE_FAILURE 500002
#define ACL_ERROR_RT_FAILURE 500003
#define ACL_ERROR_DRV_FAILURE 500004
#define ACL_ERROR_PROFILING_FAILURE 500005

#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_STREAM_CONTEXT 107003
#define ACL_ERROR_RT_ADDR_UNALIGNED 107008
#define ACL_ERROR_RT_STREAM_SUBSCRIBE 107011
#define ACL_ERROR_RT_THREAD_SUBSCRIBE 107012
#define ACL_ERROR_RT_STREAM_NO_CB_REG 107015
#define ACL_ERROR_RT_INVALID_MEMORY_TYPE 107016
#define ACL_ERROR_RT_INVALID_HANDLE 107017
#define ACL_ERROR_RT_INVALID_MALLOC_TYPE 107018
#define ACL_ERROR_RT_WAIT_TIMEOUT 107019
#define ACL_ERROR_RT_TASK_TIMEOUT 107020
#define ACL_ERROR_RT_DEVICE_TASK_ABORT 107022
/* aclrtSynchronizeStream(WithTimeout) of a stream being captured. */
#define ACL_ERROR_RT_STREAM_CAPTURED 107027
/* A call the capture mode forbids while a capture is underway (aclmdlRICaptureThreadExchangeMode). */
#define ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT 107030
/* A capture not begun RELAXED ended in another thread than the one that began it. */
#define ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD 107038
/* aclrtMemcpyAsync of pageable host memory, which runs as a synchronous copy, refused by a capture mode. */
#define ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC 107041

#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_MEMORY_FREE 207002
#define ACL_ERROR_RT_AICORE_OVER_FLOW 207003
#define ACL_ERROR_RT_NO_DEVICE 207004
#define ACL_ERROR_RT_RESOURCE_ALLOC_FAIL 207005
#define ACL_ERROR_RT_NO_PERMISSION 207006
#define ACL_ERROR_RT_NO_EVENT_RESOURCE 207007
#define ACL_ERROR_RT_NO_STREAM_RESOURCE 207008
#define ACL_ERROR_RT_OVER_LIMIT 207012
#define ACL_ERROR_RT_DEVICE_OOM 207018

#define ACL_ERROR_RT_INTERNAL_ERROR 507000
#define ACL_ERROR_RT_TS_ERROR 507001
#define ACL_ERROR_RT_STREAM_TASK_FULL 507002
#define ACL_ERROR_RT_STREAM_NOT_COMPLETE 507004
#define ACL_ERROR_RT_REPORT_TIMEOUT 507012
#define ACL_ERROR_RT_IPC_ERROR 507022
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046
#define ACL_ERROR_RT_EVENT_SYNC_TIMEOUT 507047
#define ACL_ERROR_RT_DEVICE_MEM_ERROR 507053
#define ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR 507054
#define ACL_ERROR_RT_DRV_INTERNAL_ERROR 507899
#define ACL_ERROR_RT_AICPU_INTERNAL_ERROR 507900
#define ACL_ERROR_RT_SOCKET_CLOSE 507901

/* ---- enums ---- */
typedef enum aclrtMemMallocPolicy {
    ACL_MEM_MALLOC_HUGE_FIRST = 0,
    ACL_MEM_MALLOC_HUGE_ONLY = 1,
    ACL_MEM_MALLOC_NORMAL_ONLY = 2,
    ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
    ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
    ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5,
    ACL_MEM_MALLOC_HUGE1G_ONLY = 6,
    ACL_MEM_MALLOC_HUGE1G_ONLY_P2P = 7,
    ACL_MEM_TYPE_LOW_BAND_WIDTH = 0x0100,
    ACL_MEM_TYPE_HIGH_BAND_WIDTH = 0x1000,
    /* The process's own writes fault; the runtime's copies and memsets still write (docs/runtime.md). */
    ACL_MEM_ACCESS_USER_SPACE_READONLY = 0x100000
} aclrtMemMallocPolicy;

typedef enum aclrtMemAttr {
    ACL_DDR_MEM = 0,
    ACL_HBM_MEM = 1,
    ACL_DDR_MEM_HUGE = 2,
    ACL_DDR_MEM_NORMAL = 3,
    ACL_HBM_MEM_HUGE = 4,
    ACL_HBM_MEM_NORMAL = 5,
    ACL_DDR_MEM_P2P_HUGE = 6,
    ACL_DDR_MEM_P2P_NORMAL = 7,
    ACL_HBM_MEM_P2P_HUGE = 8,
    ACL_HBM_MEM_P2P_NORMAL = 9,
    ACL_HBM_MEM_HUGE1G = 10,
    ACL_HBM_MEM_P2P_HUGE1G = 11,
    ACL_MEM_NORMAL = 12,
    ACL_MEM_HUGE = 13,
    ACL_MEM_HUGE1G = 14,
    ACL_MEM_P2P_NORMAL = 15,
    ACL_MEM_P2P_HUGE = 16,
    ACL_MEM_P2P_HUGE1G = 17
} aclrtMemAttr;

typedef enum aclrtMemcpyKind {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
    ACL_MEMCPY_DEFAULT = 4,
    ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE = 5,
    ACL_MEMCPY_INNER_DEVICE_TO_DEVICE = 6,
    ACL_MEMCPY_INTER_DEVICE_TO_DEVICE = 7
} aclrtMemcpyKind;

typedef enum aclrtMemLocationType {
    ACL_MEM_LOCATION_TYPE_HOST = 0,
    ACL_MEM_LOCATION_TYPE_DEVICE = 1,
    ACL_MEM_LOCATION_TYPE_UNREGISTERED = 2,
    ACL_MEM_LOCATION_TYPE_MANAGED = 3,
    ACL_MEM_LOCATION_TYPE_HOST_NUMA = 4
} aclrtMemLocationType;

typedef enum aclrtMemAllocationType { ACL_MEM_ALLOCATION_TYPE_PINNED = 0 } aclrtMemAllocationType;

typedef enum aclrtMemHandleType { ACL_MEM_HANDLE_TYPE_NONE = 0, ACL_MEM_HANDLE_TYPE_POSIX = 2 } aclrtMemHandleType;
/* The sharing scope CANN's V2 export and import calls take.  npualloc has the V1 calls, whose scope is
 * DEFAULT's (processes of one machine); FABRIC (across machines) has no counterpart here. */
typedef enum aclrtMemSharedHandleType {
    ACL_MEM_SHARE_HANDLE_TYPE_DEFAULT = 0x1,
    ACL_MEM_SHARE_HANDLE_TYPE_FABRIC = 0x2
} aclrtMemSharedHandleType;

typedef enum aclrtMemGranularityOptions {
    ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
    ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1,
    ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF = 0xFFFF
} aclrtMemGranularityOptions;

typedef struct aclrtMemLocation {
    uint32_t id;
    aclrtMemLocationType type;
} aclrtMemLocation;

typedef struct aclrtPhysicalMemProp {
    aclrtMemHandleType handleType;
    aclrtMemAllocationType allocationType;
    aclrtMemAttr memAttr;
    aclrtMemLocation location;
    uint64_t reserve;
} aclrtPhysicalMemProp;

typedef enum aclrtCallbackBlockType { ACL_CALLBACK_NO_BLOCK = 0, ACL_CALLBACK_BLOCK = 1 } aclrtCallbackBlockType;

typedef enum aclrtStreamStatus {
    ACL_STREAM_STATUS_COMPLETE = 0,
    ACL_STREAM_STATUS_NOT_READY = 1,
    ACL_STREAM_STATUS_RESERVED = 0xFFFF
} aclrtStreamStatus;

typedef enum aclrtEventStatus {
    ACL_EVENT_STATUS_COMPLETE = 0,
    ACL_EVENT_STATUS_NOT_READY = 1,
    ACL_EVENT_STATUS_RESERVED = 2
} aclrtEventStatus;

typedef enum aclrtEventRecordedStatus {
    ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
    ACL_EVENT_RECORDED_STATUS_COMPLETE = 1
} aclrtEventRecordedStatus;

typedef enum aclrtEventWaitStatus {
    ACL_EVENT_WAIT_STATUS_COMPLETE = 0,
    ACL_EVENT_WAIT_STATUS_NOT_READY = 1,
    ACL_EVENT_WAIT_STATUS_RESERVED = 0xFFFF
} aclrtEventWaitStatus;

/* aclrtCreateEventWithFlag / aclrtCreateEventExWithFlag flags (bits, may be OR-ed; what npualloc makes
 * of each: docs/runtime.md). */
#define ACL_EVENT_SYNC 0x00000001U
#define ACL_EVENT_CAPTURE_STREAM_PROGRESS 0x00000002U
#define ACL_EVENT_TIME_LINE 0x00000008U
#define ACL_EVENT_DEVICE_USE_ONLY 0x00000010U
#define ACL_EVENT_EXTERNAL 0x00000020U
#define ACL_EVENT_IPC 0x00000040U

/* aclrtCreateStreamWithConfig flags (bits, may be OR-ed; docs/runtime.md). */
#define ACL_STREAM_FAST_LAUNCH 0x00000001U
#define ACL_STREAM_FAST_SYNC 0x00000002U
#define ACL_STREAM_PERSISTENT 0x00000004U
#define ACL_STREAM_HUGE 0x00000008U
#define ACL_STREAM_CPU_SCHEDULE 0x00000010U
#define ACL_STREAM_DEVICE_USE_ONLY 0x00000020U

#define ACL_RT_VMM_EXPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1UL
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x1UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT 0x0UL
#define ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS 0x1UL
#define ACL_RT_NOTIFY_EXPORT_FLAG_DISABLE_PID_VALIDATION 0x02UL
#define ACL_HOST_REG_MAPPED 0x2UL
#define ACL_HOST_REG_PINNED 0x10000000UL
#define ACL_IPC_EVENT_HANDLE_SIZE 64

/* The functions stay visible outside a library built with -fvisibility=hidden (as CANN's
 * ACL_FUNC_VISIBILITY does): npualloc's Python extension exports them, so that a pluggable
 * allocator loaded into the process (npualloc.NPUPluggableAllocator) can call them. */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

/* ---- initialisation ---- */
aclError aclInit(const char *configPath);
aclError aclFinalize(void);

/* ---- devices ---- */
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtResetDevice(int32_t deviceId);
/* Resets the device whatever the number of aclrtSetDevice calls (aclrtResetDevice undoes one). */
aclError aclrtResetDeviceForce(int32_t deviceId);
aclError aclrtGetDevice(int32_t *deviceId);
aclError aclrtGetDeviceCount(uint32_t *count);
aclError aclrtSynchronizeDevice(void);
/* timeout: -1 waits forever, > 0 milliseconds; ACL_ERROR_RT_STREAM_SYNC_TIMEOUT when it ran out. */
aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout);
aclError aclrtDeviceCanAccessPeer(int32_t *canAccessPeer, int32_t deviceId, int32_t peerDeviceId);
aclError aclrtDeviceEnablePeerAccess(int32_t peerDeviceId, uint32_t flags);
aclError aclrtDeviceDisablePeerAccess(int32_t peerDeviceId);

/* ---- contexts ----
 * A context is a device and a default stream of its own (what a NULL stream means while a thread is bound to
 * it); aclrtSetDevice binds the thread to the device's default context.  aclrtCreateContext binds the new
 * context to the calling thread; aclrtDestroyContext destroys the streams made in it, and leaves a thread
 * bound to it with no context (ACL_ERROR_RT_CONTEXT_NULL).  A default context cannot be destroyed. */
aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId);
aclError aclrtDestroyContext(aclrtContext context);
aclError aclrtSetCurrentContext(aclrtContext context);
aclError aclrtGetCurrentContext(aclrtContext *context);
/* The calling thread's context's default stream: an explicit context's own stream, or NULL for a device's
 * default context (the handle that names the current device's default stream here; CANN gives that stream a
 * handle of its own).  ACL_ERROR_RT_CONTEXT_NULL without a context. */
aclError aclrtCtxGetCurrentDefaultStream(aclrtStream *stream);

typedef enum aclrtRunMode { ACL_DEVICE = 0, ACL_HOST = 1 } aclrtRunMode;
/* ACL_HOST: the program runs on the host (the only mode here). */
aclError aclrtGetRunMode(aclrtRunMode *runMode);

/* ---- plain memory ---- */
aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void *devPtr);
aclError aclrtMallocHost(void **hostPtr, size_t size);
aclError aclrtFreeHost(void *hostPtr);
aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count);
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);
/* height rows of width bytes, spitch bytes apart at src and dpitch bytes apart at dst, between host and
 * device memory (docs/runtime.md "2-D copies"). */
aclError aclrtMemcpy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                       aclrtMemcpyKind kind);
aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total);

/* ---- virtual memory management ---- */
aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, aclrtMemGranularityOptions option,
                                          size_t *granularity);
aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                             uint64_t flags);
aclError aclrtFreePhysical(aclrtDrvMemHandle handle);
aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr, uint64_t flags);
aclError aclrtReleaseMemAddress(void *virPtr);
aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags);
aclError aclrtUnmapMem(void *virPtr);

/* ---- cross-process sharing (ipc.c; design in ipc.h, user's view in docs/sharing.md) ---- */
aclError aclrtMemExportToShareableHandle(aclrtDrvMemHandle handle, aclrtMemHandleType handleType, uint64_t flags,
                                         uint64_t *shareableHandle);
aclError aclrtMemImportFromShareableHandle(uint64_t shareableHandle, int32_t deviceId, aclrtDrvMemHandle *handle);
aclError aclrtMemSetPidToShareableHandle(uint64_t shareableHandle, int32_t *pid, size_t pidNum);
aclError aclrtDeviceGetBareTgid(int32_t *pid);
aclError aclrtIpcMemGetExportKey(void *devPtr, size_t size, char *key, size_t len, uint64_t flags);
aclError aclrtIpcMemImportByKey(void **devPtr, const char *key, uint64_t flags);
aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pid, size_t num);
aclError aclrtIpcMemClose(const char *key);

/* ---- streams and events ---- */
aclError aclrtCreateStream(aclrtStream *stream);
/* priority is accepted and has no effect (CANN: reserved); flag: ACL_STREAM_* bits. */
aclError aclrtCreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
/* timeout: -1 waits forever, > 0 milliseconds; ACL_ERROR_RT_STREAM_SYNC_TIMEOUT when it ran out. */
aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);
/* COMPLETE once everything queued on the stream so far has run. */
aclError aclrtStreamQuery(aclrtStream stream, aclrtStreamStatus *status);
/* A task of the stream for device and aclrtMallocHost memory.  With pageable host memory on one side
 * (any other host address) the copy is done before the call returns: the stream is waited for (its
 * aclrtSynchronizeStream error is returned, nothing copied), then it copies as aclrtMemcpy does.  The
 * same holds for aclrtMemcpy2dAsync. */
aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream);
aclError aclrtMemcpy2dAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                            aclrtMemcpyKind kind, aclrtStream stream);
aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream);
aclError aclrtLaunchCallback(aclrtCallback fn, void *userData, aclrtCallbackBlockType blockType,
                             aclrtStream stream);
aclError aclrtSubscribeReport(uint64_t threadId, aclrtStream stream);
aclError aclrtUnSubscribeReport(uint64_t threadId, aclrtStream stream);
aclError aclrtProcessReport(int32_t timeout);
aclError aclrtCreateEvent(aclrtEvent *event);
aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag);
aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag);
/* Queued on the stream: when the stream reaches it, the event is back in its never-recorded state. */
aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtDestroyEvent(aclrtEvent event);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtQueryEvent(aclrtEvent event, aclrtEventStatus *status);
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status);
/* COMPLETE once every stream wait queued on the event (aclrtStreamWaitEvent) has finished waiting. */
aclError aclrtQueryEventWaitStatus(aclrtEvent event, aclrtEventWaitStatus *status);
aclError aclrtSynchronizeEvent(aclrtEvent event);
/* timeout: -1 waits forever, > 0 milliseconds; ACL_ERROR_RT_EVENT_SYNC_TIMEOUT when it ran out. */
aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout);
aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent);
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);

/* ---- capture modes (aclmdlRICaptureMode) ----
 * A capture's mode limits the calls CANN calls unsafe during a capture (npualloc has three of them:
 * aclrtMemcpy, aclrtMemcpy2d and aclrtMemset).  While the calling thread's current device has a capture underway,
 * such a call fails with ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT (the capture goes on), depending on
 * the thread's exchange mode (aclmdlRICaptureThreadExchangeMode, GLOBAL until changed):
 *   GLOBAL:       refused if a GLOBAL capture is underway on the device, or if the thread itself
 *                 began a THREAD_LOCAL capture;
 *   THREAD_LOCAL: refused if the thread itself began a GLOBAL or THREAD_LOCAL capture;
 *   RELAXED:      allowed.
 * So a GLOBAL capture refuses them in every thread, a THREAD_LOCAL one in the thread that began it,
 * a RELAXED one nowhere.  The asynchronous copies of pageable host memory, synchronous copies, follow
 * the same rule with ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC; on a capturing stream they, like
 * aclrtSynchronizeStream of it, fail first with ACL_ERROR_RT_STREAM_CAPTURED.  npualloc begins captures
 * with npualloc_graph_capture_begin (npualloc_graph.h), which takes the mode, not with aclmdlRICaptureBegin. */
typedef enum aclmdlRICaptureMode {
    ACL_MODEL_RI_CAPTURE_MODE_GLOBAL = 0,
    ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL,
    ACL_MODEL_RI_CAPTURE_MODE_RELAXED,
} aclmdlRICaptureMode;
/* Sets the calling thread's exchange mode to *mode and returns the previous one in *mode.
 * ACL_ERROR_INVALID_PARAM for NULL, ACL_ERROR_RT_PARAM_INVALID for a value that is not a mode,
 * ACL_ERROR_RT_CONTEXT_NULL without a current device (aclrtSetDevice). */
aclError aclmdlRICaptureThreadExchangeMode(aclmdlRICaptureMode *mode);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif
#endif /* NPUALLOC_ACL_RT_H */
