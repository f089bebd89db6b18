/*
 * replay_py.c - `npualloc._C.replay`: the Session type, a thin wrapper over a trace-replay
 * session (include/npualloc_replay.h).  npualloc/replay.py is the user-facing layer.
 *
 *   Session(settings=None, device_memory, huge1g_memory=0, pad=32, fraction=0.0,
 *           stop_on_oom=False, timeline_points=2048, max_oom_records=64, record_history=0)
 *   .feed(action, addr, size, stream, start=0, count=-1) -> bool (False once stopped)
 *   .result() -> dict   .timeline() -> (events, allocated, reserved)   .ooms() -> [dict]
 *   .warnings() -> [str]   .snapshot() -> (segments, traces)   .check() -> None
 *   .allocator_settings() -> dict (a snapshot's "allocator_settings" for the session's settings)
 *
 * Events come as buffers (array('B') / array('Q'), numpy arrays, bytes): `action` of 1-byte
 * items, the others of 8-byte items, all of one length.  feed releases the GIL, so sessions
 * in several threads run in parallel.
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "binding.h"
#include "memory_py.h"
#include "npualloc_replay.h"
#include "replay_py.h"

typedef struct {
    PyObject_HEAD
    npualloc_replay *r;
    PyObject *settings_text; /* str: the settings the session was created with, for allocator_settings() */
} SessionObject;

static PyObject *Unavailable; /* NotImplementedError subclass: a setting this build lacks */
static PyObject *DeviceError; /* RuntimeError subclass: the device refused an allocation (not for memory) */

static int Session_init(SessionObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"settings",     "device_memory",   "huge1g_memory",  "pad",
                             "fraction",     "stop_on_oom",     "timeline_points", "max_oom_records",
                             "record_history", NULL};
    const char *settings = NULL;
    unsigned long long device_memory = 0, huge1g = 0, record_history = 0;
    unsigned int pad = NPUALLOC_REPLAY_PAD_NPU, points = 2048, max_ooms = 64;
    double fraction = 0.0;
    int stop = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "zK|KIdpIIK:Session", kwlist, &settings, &device_memory, &huge1g,
                                     &pad, &fraction, &stop, &points, &max_ooms, &record_history))
        return -1;
    if (self->r) {
        PyErr_SetString(PyExc_RuntimeError, "Session is already initialised");
        return -1;
    }
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.settings = settings;
    cfg.device_memory = device_memory;
    cfg.huge1g_memory = huge1g;
    cfg.pad = pad;
    cfg.fraction = fraction;
    cfg.stop_on_oom = stop != 0;
    cfg.timeline_points = points;
    cfg.max_oom_records = max_ooms;
    cfg.record_history = (size_t)record_history;
    char err[1024];
    npualloc_replay_status st = npualloc_replay_create(&cfg, &self->r, err, sizeof err);
    switch (st) {
    case NPUALLOC_REPLAY_OK:
        self->settings_text = PyUnicode_FromString(settings ? settings : "");
        if (!self->settings_text) {
            npualloc_replay_destroy(self->r);
            self->r = NULL;
            return -1;
        }
        return 0;
    case NPUALLOC_REPLAY_BAD_SETTINGS:
    case NPUALLOC_REPLAY_BAD_CONFIG:
        PyErr_SetString(PyExc_ValueError, err);
        return -1;
    case NPUALLOC_REPLAY_UNAVAILABLE:
        PyErr_SetString(Unavailable, err);
        return -1;
    case NPUALLOC_REPLAY_HOST_MEMORY:
        PyErr_NoMemory();
        return -1;
    default:
        PyErr_Format(PyExc_RuntimeError, "replay session: %s (%s)", npualloc_replay_status_name(st), err);
        return -1;
    }
}

static void Session_dealloc(SessionObject *self)
{
    npualloc_replay_destroy(self->r);
    Py_XDECREF(self->settings_text);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static bool session_ready(SessionObject *self)
{
    if (!self->r)
        PyErr_SetString(PyExc_RuntimeError, "Session was not initialised");
    return self->r != NULL;
}

static int get_array(PyObject *o, Py_buffer *view, Py_ssize_t itemsize, const char *name)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "feed(): '%s' must hold %zd-byte items, not %zd-byte ones", name, itemsize,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *Session_feed(SessionObject *self, PyObject *args)
{
    if (!session_ready(self))
        return NULL;
    PyObject *objs[4];
    Py_ssize_t start = 0, count = -1;
    if (!PyArg_ParseTuple(args, "OOOO|nn:feed", &objs[0], &objs[1], &objs[2], &objs[3], &start, &count))
        return NULL;
    static const char *names[4] = {"action", "addr", "size", "stream"};
    Py_buffer views[4];
    int got = 0;
    PyObject *ret = NULL;
    for (; got < 4; got++)
        if (get_array(objs[got], &views[got], got == 0 ? 1 : 8, names[got]) != 0)
            goto out;
    Py_ssize_t n = views[0].len;
    for (int i = 1; i < 4; i++) {
        if (views[i].len / 8 != n) {
            PyErr_SetString(PyExc_ValueError, "feed(): action, addr, size and stream must have the same length");
            goto out;
        }
    }
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "feed(): start out of range");
        goto out;
    }
    if (count < 0 || count > n - start)
        count = n - start;
    npualloc_replay_events ev = {(const uint8_t *)views[0].buf + start, (const uint64_t *)views[1].buf + start,
                                 (const uint64_t *)views[2].buf + start, (const uint64_t *)views[3].buf + start,
                                 (size_t)count};
    npualloc_replay_status st;
    WAITING_CALL(st = npualloc_replay_feed(self->r, &ev));
    if (st == NPUALLOC_REPLAY_OK || st == NPUALLOC_REPLAY_STOPPED) {
        ret = PyBool_FromLong(st == NPUALLOC_REPLAY_OK);
    } else if (st == NPUALLOC_REPLAY_HOST_MEMORY) {
        PyErr_NoMemory();
    } else if (st == NPUALLOC_REPLAY_DEVICE_ERROR) {
        PyErr_SetString(DeviceError, npualloc_replay_error(self->r));
    } else {
        PyErr_Format(PyExc_RuntimeError, "feed(): %s", npualloc_replay_status_name(st));
    }
out:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return ret;
}

static PyObject *Session_result(SessionObject *self, PyObject *unused)
{
    (void)unused;
    if (!session_ready(self))
        return NULL;
    npualloc_replay_result r;
    npualloc_replay_get_result(self->r, &r);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:O,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:d,s:K,s:K,s:K,s:K,s:K,s:O,s:d,s:d}",
        "events", (unsigned long long)r.events, "allocs", (unsigned long long)r.allocs, "frees",
        (unsigned long long)r.frees, "unknown_frees", (unsigned long long)r.unknown_frees, "skipped_frees",
        (unsigned long long)r.skipped_frees, "duplicate_allocs", (unsigned long long)r.duplicate_allocs, "ignored",
        (unsigned long long)r.ignored, "ooms", (unsigned long long)r.ooms, "recorded_ooms",
        (unsigned long long)r.recorded_ooms, "recorded_ooms_reproduced", (unsigned long long)r.recorded_ooms_reproduced,
        "stopped", r.stopped ? Py_True : Py_False,
        "peak_requested", (unsigned long long)r.peak_requested, "peak_allocated", (unsigned long long)r.peak_allocated,
        "peak_active", (unsigned long long)r.peak_active, "peak_reserved", (unsigned long long)r.peak_reserved,
        "final_allocated", (unsigned long long)r.final_allocated, "final_reserved",
        (unsigned long long)r.final_reserved, "live_allocations", (unsigned long long)r.live_allocations,
        "fragmentation", r.fragmentation, "device_allocs", (unsigned long long)r.device_allocs, "device_frees",
        (unsigned long long)r.device_frees, "retries", (unsigned long long)r.retries, "segments",
        (unsigned long long)r.segments, "huge1g_fallbacks", (unsigned long long)r.huge1g_fallbacks, "expandable",
        r.expandable ? Py_True : Py_False, "wall_seconds", r.wall_seconds, "events_per_second", r.events_per_second);
}

static PyObject *Session_timeline(SessionObject *self, PyObject *unused)
{
    (void)unused;
    if (!session_ready(self))
        return NULL;
    size_t n = npualloc_replay_timeline(self->r, NULL, 0);
    npualloc_replay_point *pts = PyMem_Malloc((n ? n : 1) * sizeof *pts);
    if (!pts)
        return PyErr_NoMemory();
    n = npualloc_replay_timeline(self->r, pts, n);
    PyObject *ev = PyList_New((Py_ssize_t)n), *al = PyList_New((Py_ssize_t)n), *re = PyList_New((Py_ssize_t)n);
    PyObject *ret = NULL;
    if (!ev || !al || !re)
        goto out;
    for (size_t i = 0; i < n; i++) {
        PyObject *a = PyLong_FromUnsignedLongLong(pts[i].event), *b = PyLong_FromUnsignedLongLong(pts[i].allocated),
                 *c = PyLong_FromUnsignedLongLong(pts[i].reserved);
        if (!a || !b || !c) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_XDECREF(c);
            goto out;
        }
        PyList_SET_ITEM(ev, (Py_ssize_t)i, a);
        PyList_SET_ITEM(al, (Py_ssize_t)i, b);
        PyList_SET_ITEM(re, (Py_ssize_t)i, c);
    }
    ret = PyTuple_Pack(3, ev, al, re);
out:
    Py_XDECREF(ev);
    Py_XDECREF(al);
    Py_XDECREF(re);
    PyMem_Free(pts);
    return ret;
}

static PyObject *Session_ooms(SessionObject *self, PyObject *unused)
{
    (void)unused;
    if (!session_ready(self))
        return NULL;
    PyObject *list = PyList_New(0);
    npualloc_replay_oom o;
    for (size_t i = 0; list && npualloc_replay_get_oom(self->r, i, &o); i++) {
        PyObject *d = Py_BuildValue("{s:K,s:K,s:K,s:s}", "event", (unsigned long long)o.event, "size",
                                    (unsigned long long)o.size, "stream", (unsigned long long)o.stream, "message",
                                    o.message);
        if (!d || PyList_Append(list, d) != 0) {
            Py_XDECREF(d);
            Py_CLEAR(list);
            break;
        }
        Py_DECREF(d);
    }
    return list;
}

static PyObject *Session_warnings(SessionObject *self, PyObject *unused)
{
    (void)unused;
    if (!session_ready(self))
        return NULL;
    PyObject *list = PyList_New(0);
    const char *w;
    for (size_t i = 0; list && (w = npualloc_replay_warning(self->r, i)) != NULL; i++) {
        PyObject *s = PyUnicode_FromString(w);
        if (!s || PyList_Append(list, s) != 0)
            Py_CLEAR(list);
        Py_XDECREF(s);
    }
    return list;
}

/* snapshot() -> (segments, traces): segments as (address, total_size, allocated_size, active_size,
 * requested_size, stream, is_small, is_expandable, [(address, size, requested_size, state)]) and
 * traces as (action, addr, size, stream, time_us); npualloc/replay.py turns them into torch's
 * dicts. */
static PyObject *Session_snapshot(SessionObject *self, PyObject *unused)
{
    (void)unused;
    if (!session_ready(self))
        return NULL;
    npualloc_snapshot *s = NULL;
    if (npualloc_replay_snapshot(self->r, &s) != NPUALLOC_REPLAY_OK)
        return PyErr_NoMemory();
    PyObject *segs = PyList_New((Py_ssize_t)s->segment_count);
    PyObject *traces = PyList_New((Py_ssize_t)s->trace_count);
    PyObject *ret = NULL;
    if (!segs || !traces)
        goto out;
    for (size_t i = 0; i < s->segment_count; i++) {
        const npualloc_segment_info *g = &s->segments[i];
        PyObject *blocks = PyList_New((Py_ssize_t)g->block_count);
        if (!blocks)
            goto out;
        for (size_t j = 0; j < g->block_count; j++) {
            const npualloc_block_info *b = &s->blocks[g->first_block + j];
            PyObject *t = Py_BuildValue("(KKKi)", (unsigned long long)b->address, (unsigned long long)b->size,
                                        (unsigned long long)b->requested_size, (int)b->state);
            if (!t) {
                Py_DECREF(blocks);
                goto out;
            }
            PyList_SET_ITEM(blocks, (Py_ssize_t)j, t);
        }
        PyObject *t = Py_BuildValue("(KKKKKKOON)", (unsigned long long)g->address, (unsigned long long)g->total_size,
                                    (unsigned long long)g->allocated_size, (unsigned long long)g->active_size,
                                    (unsigned long long)g->requested_size, (unsigned long long)g->stream,
                                    g->is_small ? Py_True : Py_False, g->is_expandable ? Py_True : Py_False, blocks);
        if (!t)
            goto out;
        PyList_SET_ITEM(segs, (Py_ssize_t)i, t);
    }
    for (size_t i = 0; i < s->trace_count; i++) {
        const npualloc_trace_info *e = &s->traces[i];
        PyObject *t = Py_BuildValue("(iKKKL)", (int)e->action, (unsigned long long)e->addr,
                                    (unsigned long long)e->size, (unsigned long long)e->stream, (long long)e->time_us);
        if (!t)
            goto out;
        PyList_SET_ITEM(traces, (Py_ssize_t)i, t);
    }
    ret = PyTuple_Pack(2, segs, traces);
out:
    Py_XDECREF(segs);
    Py_XDECREF(traces);
    npualloc_snapshot_free(s);
    return ret;
}

/* allocator_settings() -> the "allocator_settings" dict of a snapshot recorded under the session's
 * settings (the same keys as the live _snapshot()'s). */
static PyObject *Session_allocator_settings(SessionObject *self, PyObject *unused)
{
    (void)unused;
    if (!session_ready(self))
        return NULL;
    const char *text = PyUnicode_AsUTF8(self->settings_text);
    if (!text)
        return NULL;
    npualloc_allocator_settings s;
    npualloc_replay_get_settings(self->r, &s);
    return allocator_settings_dict(&s, text);
}

static PyMethodDef Session_methods[] = {
    {"feed", (PyCFunction)Session_feed, METH_VARARGS,
     "feed(action, addr, size, stream, start=0, count=-1) -> bool: replays a chunk; False once stopped by an OOM"},
    {"result", (PyCFunction)Session_result, METH_NOARGS, "result() -> dict of counters and peaks"},
    {"timeline", (PyCFunction)Session_timeline, METH_NOARGS, "timeline() -> (events, allocated, reserved)"},
    {"ooms", (PyCFunction)Session_ooms, METH_NOARGS, "ooms() -> [dict(event, size, stream, message)]"},
    {"warnings", (PyCFunction)Session_warnings, METH_NOARGS, "warnings() -> the settings parser's warnings"},
    {"snapshot", (PyCFunction)Session_snapshot, METH_NOARGS, "snapshot() -> (segments, traces) as tuples"},
    {"allocator_settings", (PyCFunction)Session_allocator_settings, METH_NOARGS,
     "allocator_settings() -> the settings replayed under, as a snapshot's allocator_settings dict"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SessionType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "npualloc._C.replay.Session",
    .tp_basicsize = sizeof(SessionObject),
    .tp_dealloc = (destructor)Session_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A trace-replay session: a private caching allocator on a simulated device.",
    .tp_methods = Session_methods,
    .tp_init = (initproc)Session_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef replay_functions[] = {
    {"check_pickle", pickle_check, METH_O,
     "check_pickle(data): ValueError unless every opcode of the pickle stays within the data."},
    {"check_pickle_prefix", (PyCFunction)(void (*)(void))pickle_check_prefix, METH_FASTCALL,
     "check_pickle_prefix(data, start, limit) -> (resume, stopped): the part read so far of a stream of at most "
     "limit bytes, checked from start; ValueError for an opcode that is wrong whatever follows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef replay_module_def = {
    PyModuleDef_HEAD_INIT, "npualloc._C.replay", "Trace replay sessions (see npualloc.replay).", -1, replay_functions,
    NULL, NULL, NULL, NULL,
};

int replay_py_attach(PyObject *module)
{
    if (PyType_Ready(&SessionType) != 0)
        return -1;
    PyObject *m = PyModule_Create(&replay_module_def);
    if (!m)
        return -1;
    Unavailable = PyErr_NewExceptionWithDoc("npualloc._C.replay.Unavailable",
                                            "A setting this build's allocator does not implement.",
                                            PyExc_NotImplementedError, NULL);
    if (!Unavailable || PyModule_AddObject(m, "Unavailable", Unavailable) != 0)
        goto fail;
    Py_INCREF(Unavailable); /* the module's reference went to AddObject; keep ours */
    DeviceError = PyErr_NewExceptionWithDoc("npualloc._C.replay.DeviceError",
                                            "The simulated device refused an allocation for another reason than "
                                            "memory: the setting cannot run there.",
                                            PyExc_RuntimeError, NULL);
    if (!DeviceError || PyModule_AddObject(m, "DeviceError", DeviceError) != 0)
        goto fail;
    Py_INCREF(DeviceError);
    Py_INCREF(&SessionType);
    if (PyModule_AddObject(m, "Session", (PyObject *)&SessionType) != 0) {
        Py_DECREF(&SessionType);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "PAD_NPU", NPUALLOC_REPLAY_PAD_NPU) != 0 ||
        PyModule_AddIntConstant(m, "PAD_CUDA", NPUALLOC_REPLAY_PAD_CUDA) != 0 ||
        PyModule_AddIntConstant(m, "ALLOC", NPUALLOC_REPLAY_ALLOC) != 0 ||
        PyModule_AddIntConstant(m, "FREE", NPUALLOC_REPLAY_FREE) != 0 ||
        PyModule_AddIntConstant(m, "FREE_REQUESTED", NPUALLOC_REPLAY_FREE_REQUESTED) != 0 ||
        PyModule_AddIntConstant(m, "FREE_COMPLETED", NPUALLOC_REPLAY_FREE_COMPLETED) != 0 ||
        PyModule_AddIntConstant(m, "OOM", NPUALLOC_REPLAY_OOM) != 0 ||
        PyModule_AddIntConstant(m, "EMPTY_CACHE", NPUALLOC_REPLAY_EMPTY_CACHE) != 0)
        goto fail;
    if (PyModule_AddObject(module, "replay", m) != 0)
        goto fail;
    return 0;
fail:
    Py_DECREF(m);
    return -1;
}
