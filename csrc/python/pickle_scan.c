/*
 * pickle_scan.c - a bounds check of a pickle's opcodes before it is unpickled
 * (`npualloc._C.replay.check_pickle(data)`), so that a small hostile file cannot make the
 * unpickler allocate far more than the file holds.
 *
 * Why: CPython's C unpickler grows its memo array to the index a PUT names (a 7-byte file can
 * ask for gigabytes, and the array is touched), and allocates a counted string or frame before
 * reading it.  This walks the opcodes once (protocols 0-5, argument formats as in pickletools),
 * without building any object, and refuses: an unknown opcode, an argument running past the end,
 * a counted length larger than the bytes left, and a memo index larger than the file (a pickle
 * cannot store more objects than it has bytes).  It runs at memory speed: the unpickler itself
 * still decides what the data means.  `check_pickle_prefix(data, start, limit)` checks a stream as
 * it is read, so that one that goes wrong early is refused before the rest is read.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef enum arg_kind {
    ARG_NONE,
    ARG_FIXED,     /* `width` bytes */
    ARG_COUNTED,   /* a little-endian length of `width` bytes, then that many bytes */
    ARG_LINE,      /* one newline-terminated line */
    ARG_TWO_LINES, /* GLOBAL and INST: module and name */
    ARG_BAD,       /* not an opcode */
} arg_kind;

typedef struct opcode_format {
    uint8_t kind;  /* arg_kind */
    uint8_t width; /* ARG_FIXED / ARG_COUNTED */
    uint8_t memo;  /* 1: the argument is a memo index the unpickler stores at (PUT family) */
} opcode_format;

static opcode_format formats[256];

static void set(unsigned char op, arg_kind kind, uint8_t width, uint8_t memo)
{
    formats[op] = (opcode_format){(uint8_t)kind, width, memo};
}

static void formats_init(void)
{
    for (int i = 0; i < 256; i++)
        formats[i].kind = ARG_BAD;
    static const char no_arg[] = "(.012NQRabd}el])ost)u" /* protocols 0 and 1 */
                                 "\x81\x85\x86\x87\x88\x89"  /* protocol 2 */
                                 "\x8f\x90\x91\x92\x93\x94"  /* protocol 4 */
                                 "\x97\x98";                 /* protocol 5 */
    for (const char *p = no_arg; *p; p++)
        set((unsigned char)*p, ARG_NONE, 0, 0);
    set('F', ARG_LINE, 0, 0);
    set('I', ARG_LINE, 0, 0);
    set('L', ARG_LINE, 0, 0);
    set('P', ARG_LINE, 0, 0);
    set('S', ARG_LINE, 0, 0);
    set('V', ARG_LINE, 0, 0);
    set('g', ARG_LINE, 0, 0);
    set('p', ARG_LINE, 0, 1);
    set('c', ARG_TWO_LINES, 0, 0);
    set('i', ARG_TWO_LINES, 0, 0);
    set('J', ARG_FIXED, 4, 0);
    set('K', ARG_FIXED, 1, 0);
    set('M', ARG_FIXED, 2, 0);
    set('G', ARG_FIXED, 8, 0);
    set('h', ARG_FIXED, 1, 0);
    set('j', ARG_FIXED, 4, 0);
    set('q', ARG_FIXED, 1, 1);
    set('r', ARG_FIXED, 4, 1);
    set('\x80', ARG_FIXED, 1, 0); /* PROTO */
    set('\x82', ARG_FIXED, 1, 0); /* EXT1 */
    set('\x83', ARG_FIXED, 2, 0);
    set('\x84', ARG_FIXED, 4, 0);
    set('\x95', ARG_FIXED, 8, 0); /* FRAME: its length is checked like a count */
    set('T', ARG_COUNTED, 4, 0);  /* BINSTRING */
    set('U', ARG_COUNTED, 1, 0);
    set('X', ARG_COUNTED, 4, 0);  /* BINUNICODE */
    set('B', ARG_COUNTED, 4, 0);  /* BINBYTES */
    set('C', ARG_COUNTED, 1, 0);
    set('\x8a', ARG_COUNTED, 1, 0); /* LONG1 */
    set('\x8b', ARG_COUNTED, 4, 0); /* LONG4 */
    set('\x8c', ARG_COUNTED, 1, 0); /* SHORT_BINUNICODE */
    set('\x8d', ARG_COUNTED, 8, 0); /* BINUNICODE8 */
    set('\x8e', ARG_COUNTED, 8, 0); /* BINBYTES8 */
    set('\x96', ARG_COUNTED, 8, 0); /* BYTEARRAY8 */
}

static uint64_t little_endian(const unsigned char *p, int width)
{
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* The offset just past the line starting at `at`, 0 when the data ends first, or SIZE_MAX when the line
 * holds a NUL byte: no line argument of any protocol does (protocol 0 escapes it in strings), and a
 * stream of zeros after a line opcode would otherwise be read to the limit. */
static size_t line_end(const unsigned char *d, size_t n, size_t at)
{
    const unsigned char *nl = memchr(d + at, '\n', n - at);
    size_t end = nl ? (size_t)(nl - d) : n;
    if (memchr(d + at, '\0', end - at))
        return SIZE_MAX;
    return nl ? end + 1 : 0;
}

/* NULL when the opcodes from `at` on are within bounds, else what is wrong (at *where).  The pickle may
 * take `limit` bytes in all (at least n): while that is more than the data holds (a stream still being
 * read), an opcode cut off by the data's end is no error: the scan stops before it, with *where there,
 * and memo indices are checked against the whole data later.  A length or frame reaching past `limit`
 * is an error at once.  *stopped tells that the scan reached STOP (*where just past it). */
static const char *scan(const unsigned char *d, size_t n, size_t at, size_t limit, size_t *where, bool *stopped)
{
    const bool more_may_come = limit > n;
    const char *cut_off = NULL; /* what an opcode cut off by the end of the data is */
    *stopped = false;
    while (at < n && !cut_off) {
        *where = at;
        unsigned char op = d[at++];
        opcode_format f = formats[op];
        uint64_t value = 0;
        switch ((arg_kind)f.kind) {
        case ARG_BAD:
            return "unknown opcode";
        case ARG_NONE:
            if (op == '.') { /* STOP: the unpickler reads nothing after it */
                *where = at;
                *stopped = true;
                return NULL;
            }
            break;
        case ARG_FIXED:
            if (n - at < f.width) {
                cut_off = "truncated argument";
                break;
            }
            value = little_endian(d + at, f.width);
            at += f.width;
            if (op == 0x95 && value > limit - at)
                return more_may_come ? "frame beyond the memory limit" : "frame longer than the data";
            if (op == 0x95 && value > n - at)
                cut_off = "frame longer than the data";
            break;
        case ARG_COUNTED:
            if (n - at < f.width) {
                cut_off = "truncated length";
                break;
            }
            value = little_endian(d + at, f.width);
            at += f.width;
            if (value > limit - at)
                return more_may_come ? "length beyond the memory limit" : "length beyond the end of the data";
            if (value > n - at)
                cut_off = "length beyond the end of the data";
            else
                at += (size_t)value;
            break;
        case ARG_LINE: {
            size_t end = line_end(d, n, at);
            if (end == SIZE_MAX)
                return "NUL byte in a line";
            if (!end) {
                cut_off = "unterminated line";
                break;
            }
            if (f.memo) {
                char digits[24];
                size_t len = end - 1 - at;
                if (len == 0 || len >= sizeof digits)
                    return "bad memo index";
                memcpy(digits, d + at, len);
                digits[len] = '\0';
                char *stop;
                unsigned long long v = strtoull(digits, &stop, 10);
                if (*stop != '\0' && *stop != '\r')
                    return "bad memo index";
                value = v;
            }
            at = end;
            break;
        }
        case ARG_TWO_LINES: {
            size_t end = line_end(d, n, at);
            if (end && end != SIZE_MAX)
                end = line_end(d, n, end);
            if (end == SIZE_MAX)
                return "NUL byte in a line";
            if (!end)
                cut_off = "unterminated line";
            else
                at = end;
            break;
        }
        }
        if (!cut_off && !more_may_come && f.memo && value > n)
            return "memo index larger than the data";
    }
    if (!cut_off)
        *where = n;
    return more_may_come ? NULL : cut_off ? cut_off : "no STOP opcode";
}

static void formats_ready(void)
{
    static int ready;
    if (!ready) { /* under the GIL */
        formats_init();
        ready = 1;
    }
}

PyObject *pickle_check(PyObject *self, PyObject *arg)
{
    (void)self;
    formats_ready();
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0)
        return NULL;
    size_t where = 0;
    bool stopped;
    const char *why = scan(view.buf, (size_t)view.len, 0, (size_t)view.len, &where, &stopped);
    PyBuffer_Release(&view);
    if (why)
        return PyErr_Format(PyExc_ValueError, "%s at byte %zu", why, where);
    Py_RETURN_NONE;
}

PyObject *pickle_check_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t start, limit;
    if (nargs != 3 || !PyIndex_Check(args[1]) || !PyIndex_Check(args[2]))
        return PyErr_Format(PyExc_TypeError, "check_pickle_prefix(data, start, limit) takes a buffer and two ints");
    if (((start = PyNumber_AsSsize_t(args[1], PyExc_OverflowError)) == -1 ||
         (limit = PyNumber_AsSsize_t(args[2], PyExc_OverflowError)) == -1) &&
        PyErr_Occurred())
        return NULL;
    formats_ready();
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0)
        return NULL;
    if (start < 0 || start > view.len) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "start %zd is outside the data (%zd bytes)", start, view.len);
    }
    size_t where = (size_t)start;
    bool stopped;
    size_t most = limit > view.len ? (size_t)limit : (size_t)view.len;
    const char *why = scan(view.buf, (size_t)view.len, (size_t)start, most, &where, &stopped);
    PyBuffer_Release(&view);
    if (why)
        return PyErr_Format(PyExc_ValueError, "%s at byte %zu", why, where);
    return Py_BuildValue("(nO)", (Py_ssize_t)where, stopped ? Py_True : Py_False);
}
