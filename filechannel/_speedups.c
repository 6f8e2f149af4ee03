/*
 * filechannel._speedups: the optional C fast path for the per-event hot loops.
 *
 * This module owns these functions and nothing else:
 *
 *   encode_puts(seed, kind, woid, txn_id, payloads, offsets, sizes, offset, seal, tag_len)
 *       frames and checksums a batch of PUT records in one call; the twin of
 *       format._RecordEncoder.add_puts (same bytes, same offsets and sizes).
 *       An encrypted file passes its sealer: it is called once per payload,
 *       exactly as the Python twin calls it (the cipher is cryptography's C).
 *   scan_batches(buf, pos, seed, kind, max_payload, batch_last_woid,
 *                base, file_id, record_type, records[, run_type, offsets, sizes])
 *       walks records from ``pos`` while they form complete, verified batches,
 *       appending one ``record_type`` (scan.LogRecord) per record to ``records``
 *       (with ``run_type``, scan.PutRun: one per stretch of a transaction's PUTs,
 *       their pointers in the ``offsets``/``sizes`` array("q") columns);
 *       it stops at the first thing that is not a clean verified batch and
 *       returns where, so that scan.Scanner's Python loop (the reference
 *       implementation) takes over there and decides what it means.
 *   decode_puts(buf, offsets, sizes, seed, kind, max_payload, decode, frame_error, event_error)
 *       verifies the records a take reads from disk (one buffer per run of adjacent records)
 *       and decodes their events in one call; the twin of format._decode_puts: per
 *       record (body, headers), the payload bytes (sealed, or decode off), or an
 *       instance of frame_error / event_error (FormatError / EventFormatError,
 *       returned, not raised) with the offset and reason the Python twin gives.
 *   trim_heap()
 *       hands free heap pages back to the system (glibc's malloc_trim) once a
 *       full replay has freed its scan (see channel.replay_queue).
 *   put_column, column_frames_size, encode_column
 *       a transaction's puts as a column (one data buffer, int64 offsets: Transaction.put_arrow)
 *       and their PUT frames, the bytes of encode_puts, without a Python object per payload.
 *   arrow_verify, arrow_events, arrow_puts, arrow_payload_column, merge_headers
 *       the Arrow read and put paths (filechannel/arrow.py holds their callers and
 *       their pure-Python twins): a segment's PUT records checked, its event payloads
 *       decoded straight into the buffers of Arrow arrays, and an Arrow body column
 *       (with its map headers) turned into PUT payloads, each in one call. They build
 *       plain bytes buffers; pyarrow wraps them (pa.py_buffer, Array.from_buffers).
 *
 * It performs no I/O, holds no state and never decides policy: every damage
 * decision stays in scan.py. Both functions accept any object with the buffer
 * protocol. The CRC-32C is google-crc32c's own C library (crc32c_extend in the
 * libcrc32c its wheel ships, bound at import by format.py) when it can be
 * found, else the SSE4.2 ``crc32`` instruction when the CPU has it (checked at
 * import), else a slicing-by-8 table; the zlib CRC-32 is zlib's own crc32(),
 * the library Python's zlib module wraps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>
#include <dlfcn.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FC_HAVE_SSE42_PATH 1
#include <nmmintrin.h>
#endif

#define KIND_CRC32C 1
#define KIND_CRC32_ZLIB 2
#define OP_PUT 1
#define OP_BATCH_END 5
#define OP_MARK 7
#define OP_MAX 7
#define FLAG_SEALED 1 /* format.FLAG_SEALED: a PUT or MARK whose payload is encrypted */
#define ENC_TAG_LEN 16 /* format.ENC_TAG_LEN: what sealing adds to a payload */
#define HEADER_LEN 32
#define BATCH_END_PAYLOAD 32
#define OP_TAKE 2
#define TAKE_RANGE_LEN 16
/* format.MARK_MIN_PAYLOAD, format.MARK_MAX_PAYLOAD: the lengths a MARK (variable payload) may have;
   a sealed one's are ENC_TAG_LEN more (format.mark_len_bounds). */
#define MARK_MIN 21
#define MARK_MAX (8 + 64 * (12 + 128 + 1024))
/* format.decode_record's flag rule: no flag, or FLAG_SEALED on a PUT or a MARK (format.SEALABLE_OPS). */
#define FLAGS_OK(op, flags) ((flags) == 0 || ((flags) == FLAG_SEALED && ((op) == OP_PUT || (op) == OP_MARK)))

/* format.FIXED_PAYLOAD_SIZES: the payload lengths an op other than PUT and TAKE may have (a 0
   ends each list). batch_end_sizes is format.BATCH_END_SIZES: extend both together. */
static const uint32_t commit_sizes[] = {16, 0};
static const uint32_t take_sizes[] = {0};
static const uint32_t rollback_sizes[] = {8, 0};
static const uint32_t batch_end_sizes[] = {BATCH_END_PAYLOAD, BATCH_END_PAYLOAD + 16, 0}; /* version 2: + the tag */
static const uint32_t retire_sizes[] = {8, 0};
static const char *const op_names[OP_MAX + 1] = {"",         "put",       "take",   "commit",
                                                 "rollback", "batch_end", "retire", "mark"};
/* NULL: an op whose payload length is open (PUT) or checked on its own (TAKE's ranges, MARK's bounds). */
static const uint32_t *const fixed_sizes[OP_MAX + 1] = {NULL,           NULL,            take_sizes,   commit_sizes,
                                                         rollback_sizes, batch_end_sizes, retire_sizes, NULL};

/* ------------------------------------------------------------------------ */
/* CRC-32C */

static uint32_t crc32c_table[8][256];
static int have_sse42 = 0;

static void
crc32c_init_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc32c_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc32c_table[0][c & 0xFF] ^ (c >> 8);
            crc32c_table[t][i] = c;
        }
    }
}

static uint32_t
crc32c_sw(uint32_t crc, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = crc32c_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = crc32c_table[7][w & 0xFF] ^ crc32c_table[6][(w >> 8) & 0xFF] ^ crc32c_table[5][(w >> 16) & 0xFF] ^
              crc32c_table[4][(w >> 24) & 0xFF] ^ crc32c_table[3][(w >> 32) & 0xFF] ^
              crc32c_table[2][(w >> 40) & 0xFF] ^ crc32c_table[1][(w >> 48) & 0xFF] ^ crc32c_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc32c_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return crc;
}

#ifdef FC_HAVE_SSE42_PATH
__attribute__((target("sse4.2"))) static uint32_t
crc32c_hw(uint32_t crc, const unsigned char *p, size_t n)
{
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    /* One stream of 8-byte steps: several GB/s, well above what the disk takes. */
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = _mm_crc32_u64(c, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}
#endif

/* google-crc32c's own C library (crc32c_extend from libcrc32c), when bind_crc32c() found it. */
typedef uint32_t (*lib_extend_fn)(uint32_t, const uint8_t *, size_t);
static lib_extend_fn lib_crc32c_extend = NULL;
static int force_table = 0; /* tests: use the table even where SSE4.2 exists */

/* Extend a finished CRC-32C value, as google_crc32c.extend(crc, data) does. */
static uint32_t
crc32c_extend(uint32_t crc, const unsigned char *p, size_t n)
{
    if (lib_crc32c_extend != NULL)
        return lib_crc32c_extend(crc, p, n);
#ifdef FC_HAVE_SSE42_PATH
    if (have_sse42 && !force_table)
        return ~crc32c_hw(~crc, p, n);
#endif
    return ~crc32c_sw(~crc, p, n);
}

static uint32_t
zlib_extend(uint32_t crc, const unsigned char *p, size_t n)
{
    uLong c = crc;
    while (n > 0) {
        uInt chunk = n > 0x40000000u ? 0x40000000u : (uInt)n;
        c = crc32(c, p, chunk);
        p += chunk;
        n -= chunk;
    }
    return (uint32_t)c;
}

typedef uint32_t (*extend_fn)(uint32_t, const unsigned char *, size_t);

static extend_fn
pick_extend(int kind)
{
    if (kind == KIND_CRC32C)
        return crc32c_extend;
    if (kind == KIND_CRC32_ZLIB)
        return zlib_extend;
    return NULL;
}

/* pick_extend, or NULL with a ValueError naming ``kind`` */
static extend_fn
extend_for(int kind)
{
    extend_fn ext = pick_extend(kind);
    if (ext == NULL)
        PyErr_Format(PyExc_ValueError, "unknown checksum algorithm %d", kind);
    return ext;
}

/* ------------------------------------------------------------------------ */
/* little-endian helpers */

static inline void
put_u16(unsigned char *p, uint16_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static inline void
put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static inline void
put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static inline uint32_t
get_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static inline uint64_t
get_u64(const unsigned char *p)
{
    return (uint64_t)get_u32(p) | ((uint64_t)get_u32(p + 4) << 32);
}

/* ------------------------------------------------------------------------ */
/* crc(kind, data, seed): the checksum on its own (used by tests to compare with google-crc32c) */

/* Buffers at least this long are checksummed without the GIL. */
#define CRC_RELEASE_GIL (64 * 1024)

static PyObject *
sp_crc(PyObject *self, PyObject *args)
{
    int kind;
    Py_buffer data;
    unsigned long seed = 0;
    if (!PyArg_ParseTuple(args, "iy*|k", &kind, &data, &seed))
        return NULL;
    extend_fn ext = extend_for(kind);
    if (ext == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    uint32_t c;
    if (data.len >= CRC_RELEASE_GIL) {
        /* Long buffers (a checkpoint's blocks): let other threads run meanwhile. The buffer is
           held (exported) for the call, so it cannot be resized under us. */
        Py_BEGIN_ALLOW_THREADS
        c = ext((uint32_t)seed, (const unsigned char *)data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        c = ext((uint32_t)seed, (const unsigned char *)data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(c);
}

/* bind_crc32c(path): use crc32c_extend from the libcrc32c the google-crc32c wheel ships (already
   loaded by ``import google_crc32c``). Returns whether it was bound; on any failure the built-in
   implementation stays. A test checks both against google_crc32c.extend. */
static PyObject *
sp_bind_crc32c(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL)
        Py_RETURN_FALSE;
    void *sym = dlsym(h, "crc32c_extend");
    if (sym == NULL) {
        dlclose(h);
        Py_RETURN_FALSE;
    }
    /* the handle stays open for the life of the process */
    lib_crc32c_extend = (lib_extend_fn)sym;
    Py_RETURN_TRUE;
}

/* unbind_crc32c(): back to the built-in implementation (tests compare the two). */
static PyObject *
sp_unbind_crc32c(PyObject *self, PyObject *args)
{
    lib_crc32c_extend = NULL;
    Py_RETURN_NONE;
}

/* crc32c_impl(): which CRC-32C this module uses now. */
static PyObject *
sp_crc32c_impl(PyObject *self, PyObject *args)
{
    if (lib_crc32c_extend != NULL)
        return PyUnicode_FromString("google-crc32c");
    return PyUnicode_FromString(have_sse42 && !force_table ? "sse4.2" : "table");
}

/* use_table(flag): tests only; with flag set (and no library bound) the table runs even with SSE4.2. */
static PyObject *
sp_use_table(PyObject *self, PyObject *args)
{
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag))
        return NULL;
    force_table = flag;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------ */
/* encode_puts */

/* Append a new reference ``item`` to ``list`` and drop it (NULL: its constructor failed, the error
   is set). The one shape of every "build an object, append it" in this file. */
static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

static int
append_ssize(PyObject *list, Py_ssize_t v)
{
    return append_new(list, PyLong_FromSsize_t(v));
}

static int extend_column(PyObject *arr, const int64_t *v, Py_ssize_t n);

static PyObject *
sp_encode_puts(PyObject *self, PyObject *args)
{
    unsigned long seed_l;
    int kind;
    unsigned long long woid, txn_id;
    PyObject *payloads, *offsets, *sizes;
    Py_ssize_t offset;
    PyObject *seal = Py_None;
    Py_ssize_t tag_len = 0;
    const char *prefix = "";
    Py_ssize_t prefix_len = 0;
    if (!PyArg_ParseTuple(args, "kiKKOOOn|Ony#", &seed_l, &kind, &woid, &txn_id, &payloads, &offsets, &sizes, &offset,
                          &seal, &tag_len, &prefix, &prefix_len))
        return NULL;
    /* prefix: bytes every payload starts with that the caller did not join to it (an event
       without headers: its 4-byte empty header block); the frame holds prefix + payload */
    /* offsets and sizes: lists (each value appended as an int), or array("q") columns (extended
       once, from the int64 values, at the end) */
    if (!PyList_Check(offsets) && !PyObject_HasAttrString(offsets, "frombytes")) {
        PyErr_SetString(PyExc_TypeError, "offsets must be a list or an array('q')");
        return NULL;
    }
    if (!PyList_Check(sizes) && !PyObject_HasAttrString(sizes, "frombytes")) {
        PyErr_SetString(PyExc_TypeError, "sizes must be a list or an array('q')");
        return NULL;
    }
    if (seal == Py_None)
        tag_len = 0;
    else if (tag_len < 0) {
        PyErr_SetString(PyExc_ValueError, "tag_len must not be negative");
        return NULL;
    }
    extend_fn ext = extend_for(kind);
    if (ext == NULL)
        return NULL;
    uint32_t seed = (uint32_t)seed_l;
    PyObject *seq = PySequence_Fast(payloads, "payloads must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *bufs = NULL;
    int64_t *cols = NULL; /* each frame's offset, then each frame's size */
    Py_ssize_t got = 0;
    PyObject *out = NULL;
    if (count > 0) {
        bufs = PyMem_Calloc((size_t)count, sizeof(Py_buffer));
        cols = PyMem_Malloc((size_t)count * 2 * sizeof(int64_t));
        if (bufs == NULL || cols == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_ssize_t total = 0;
    for (; got < count; got++) {
        if (kind == KIND_CRC32C && seal == Py_None && prefix_len == 0 && !PyBytes_Check(items[got])) {
            /* google_crc32c.extend ("y#"), which the Python twin calls on the payload, takes bytes only */
            PyErr_Format(PyExc_TypeError, "argument 2 must be read-only bytes-like object, not %.100s",
                         Py_TYPE(items[got])->tp_name);
            goto done;
        }
        if (PyObject_GetBuffer(items[got], &bufs[got], PyBUF_SIMPLE) < 0)
            goto done;
        Py_ssize_t n = prefix_len + bufs[got].len + tag_len;
        if ((unsigned long long)n > 0xFFFFFFFFull) {
            PyErr_SetString(PyExc_OverflowError, "record payload does not fit a u32 length");
            goto done;
        }
        total += HEADER_LEN + n + (-n & 7);
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t n = prefix_len + bufs[i].len + tag_len;
        Py_ssize_t pad = -n & 7;
        p[0] = OP_PUT;
        p[1] = seal != Py_None ? FLAG_SEALED : 0; /* a sealed PUT says so in its frame */
        put_u16(p + 2, 0);
        put_u32(p + 4, (uint32_t)n);
        put_u64(p + 8, (uint64_t)woid);
        put_u64(p + 16, (uint64_t)txn_id);
        const unsigned char *body = (const unsigned char *)bufs[i].buf;
        Py_ssize_t body_len = bufs[i].len;
        PyObject *ct = NULL;
        if (seal != Py_None) {
            /* seal(frame bytes [0, 24), offset, payload) -> ciphertext, as the Python twin calls it
               (with a prefix, the payload it seals is prefix + payload, one bytes object) */
            PyObject *head = PyBytes_FromStringAndSize((const char *)p, 24);
            PyObject *off_obj = head ? PyLong_FromSsize_t(offset) : NULL;
            PyObject *plain = items[i];
            if (off_obj != NULL && prefix_len > 0) {
                plain = PyBytes_FromStringAndSize(NULL, prefix_len + body_len);
                if (plain != NULL) {
                    memcpy(PyBytes_AS_STRING(plain), prefix, (size_t)prefix_len);
                    memcpy(PyBytes_AS_STRING(plain) + prefix_len, body, (size_t)body_len);
                }
            }
            if (off_obj != NULL && plain != NULL) {
                PyObject *argv[3] = {head, off_obj, plain};
                ct = PyObject_Vectorcall(seal, argv, 3, NULL);
            }
            if (plain != items[i])
                Py_XDECREF(plain);
            Py_XDECREF(head);
            Py_XDECREF(off_obj);
            if (ct == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            if (!PyBytes_Check(ct) || PyBytes_GET_SIZE(ct) != n) {
                PyErr_Format(PyExc_ValueError, "the sealer returned %zd bytes for a %zd-byte sealed payload",
                             PyBytes_Check(ct) ? PyBytes_GET_SIZE(ct) : (Py_ssize_t)-1, n);
                Py_DECREF(ct);
                Py_CLEAR(out);
                goto done;
            }
            body = (const unsigned char *)PyBytes_AS_STRING(ct);
        }
        uint32_t c = ext(seed, p, 24);
        if (ct != NULL) { /* the ciphertext is the whole stored payload */
            c = ext(c, body, (size_t)n);
            memcpy(p + HEADER_LEN, body, (size_t)n);
        } else { /* prefix, then the payload */
            c = ext(c, (const unsigned char *)prefix, (size_t)prefix_len);
            c = ext(c, body, (size_t)body_len);
            memcpy(p + HEADER_LEN, prefix, (size_t)prefix_len);
            memcpy(p + HEADER_LEN + prefix_len, body, (size_t)body_len);
        }
        put_u32(p + 24, c);
        put_u32(p + 28, 0);
        Py_XDECREF(ct);
        memset(p + HEADER_LEN + n, 0, (size_t)pad);
        Py_ssize_t size = HEADER_LEN + n + pad;
        cols[i] = offset;
        cols[count + i] = size;
        offset += size;
        p += size;
        woid++;
    }
    if (out != NULL && count > 0) {
        for (int k = 0; k < 2; k++) {
            PyObject *col = k == 0 ? offsets : sizes;
            const int64_t *v = cols + (k == 0 ? 0 : count);
            int bad = 0;
            if (PyList_Check(col)) {
                for (Py_ssize_t i = 0; i < count && !bad; i++)
                    bad = append_ssize(col, (Py_ssize_t)v[i]) < 0;
            } else {
                bad = extend_column(col, v, count) < 0;
            }
            if (bad) {
                Py_CLEAR(out);
                break;
            }
        }
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(cols);
    Py_DECREF(seq);
    if (out == NULL)
        return NULL;
    PyObject *r = Py_BuildValue("(Nn)", out, offset);
    return r;
}

/* frame_record(seed, kind, head, payload) -> bytes: one record's frame, the twin of
   format._RecordEncoder.add once the caller has packed the 24-byte ``head`` (so packing errors
   stay struct's): head, checksum over head and payload, zero word, payload, zero padding to 8. */
static PyObject *
sp_frame_record(PyObject *self, PyObject *args)
{
    unsigned long seed_l;
    int kind;
    PyObject *head, *payload;
    if (!PyArg_ParseTuple(args, "kiO!O", &seed_l, &kind, &PyBytes_Type, &head, &payload))
        return NULL;
    extend_fn ext = extend_for(kind);
    if (ext == NULL)
        return NULL;
    if (PyBytes_GET_SIZE(head) != 24) {
        PyErr_SetString(PyExc_ValueError, "a record head is 24 bytes");
        return NULL;
    }
    if (kind == KIND_CRC32C && !PyBytes_Check(payload)) {
        /* google_crc32c.extend ("y#"), which the Python twin calls on the payload, takes bytes only */
        PyErr_Format(PyExc_TypeError, "argument 2 must be read-only bytes-like object, not %.100s",
                     Py_TYPE(payload)->tp_name);
        return NULL;
    }
    Py_buffer pb;
    if (PyObject_GetBuffer(payload, &pb, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t n = pb.len;
    Py_ssize_t pad = -n & 7;
    PyObject *out = PyBytes_FromStringAndSize(NULL, HEADER_LEN + n + pad);
    if (out != NULL) {
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
        memcpy(p, PyBytes_AS_STRING(head), 24);
        uint32_t c = ext((uint32_t)seed_l, p, 24);
        c = ext(c, (const unsigned char *)pb.buf, (size_t)n);
        put_u32(p + 24, c);
        put_u32(p + 28, 0);
        memcpy(p + HEADER_LEN, pb.buf, (size_t)n);
        memset(p + HEADER_LEN + n, 0, (size_t)pad);
    }
    PyBuffer_Release(&pb);
    return out;
}

/* ------------------------------------------------------------------------ */
/* scan_batches */

typedef struct {
    unsigned char op, flags;
    uint64_t woid, txn_id;
    Py_ssize_t offset, size, payload_len;
} pending_rec;

/* What format.decode_record checks of a payload length before it reads the payload (``op`` is
   valid): 0 fine, 1 a fixed-size op's length is not one it may have, 2 a TAKE's does not hold
   whole ranges, 3 a MARK's is out of its bounds (a sealed one's, ``flags``, ENC_TAG_LEN higher). Constant
   work, so refusing a frame never costs a checksum of its claimed length. */
static int
payload_len_check(unsigned char op, unsigned char flags, uint32_t plen)
{
    if (op == OP_TAKE)
        return plen < 4 || (plen - 4) % TAKE_RANGE_LEN ? 2 : 0;
    if (op == OP_MARK) {
        uint32_t grow = flags == FLAG_SEALED ? ENC_TAG_LEN : 0;
        return plen < MARK_MIN + grow || plen > MARK_MAX + grow ? 3 : 0;
    }
    const uint32_t *ok = fixed_sizes[op];
    if (ok == NULL)
        return 0;
    for (; *ok; ok++)
        if (*ok == plen)
            return 0;
    return 1;
}

/* A TAKE whose range count (its first 4 payload bytes, present) disagrees with its length. */
static int
take_count_bad(unsigned char op, const unsigned char *payload, uint32_t plen)
{
    return op == OP_TAKE && get_u32(payload) != (plen - 4) / TAKE_RANGE_LEN;
}

/* format.payload_len_error's text: "<op> payload length <n> is not 16" (or "32 or 48"). */
static PyObject *
payload_len_reason(unsigned char op, uint32_t plen)
{
    PyObject *sizes = PyUnicode_FromString("");
    for (const uint32_t *ok = fixed_sizes[op]; sizes != NULL && *ok; ok++) {
        PyObject *next = PyUnicode_FromFormat(ok == fixed_sizes[op] ? "%U%lu" : "%U or %lu", sizes, (unsigned long)*ok);
        Py_DECREF(sizes);
        sizes = next;
    }
    if (sizes == NULL)
        return NULL;
    PyObject *out = PyUnicode_FromFormat("%s payload length %lu is not %U", op_names[op], (unsigned long)plen, sizes);
    Py_DECREF(sizes);
    return out;
}

/* Decode the frame at ``pos``; return its size, or 0 when it is not a valid, complete record. */
static Py_ssize_t
decode_frame(const unsigned char *b, Py_ssize_t n, Py_ssize_t pos, uint32_t seed, extend_fn ext,
             unsigned long long max_payload, pending_rec *r)
{
    if (n - pos < HEADER_LEN)
        return 0;
    const unsigned char *h = b + pos;
    unsigned char op = h[0];
    if (op < 1 || op > OP_MAX || !FLAGS_OK(op, h[1]) || h[2] != 0 || h[3] != 0)
        return 0;
    uint32_t plen = get_u32(h + 4);
    if ((unsigned long long)plen > max_payload || payload_len_check(op, h[1], plen))
        return 0;
    Py_ssize_t size = HEADER_LEN + (Py_ssize_t)plen + (-(Py_ssize_t)plen & 7);
    if (n - pos < size)
        return 0;
    if (get_u32(h + 28) != 0 || take_count_bad(op, h + HEADER_LEN, plen))
        return 0;
    uint32_t c = ext(seed, h, 24);
    c = ext(c, h + HEADER_LEN, plen);
    if (c != get_u32(h + 24))
        return 0;
    r->op = op;
    r->flags = h[1];
    r->woid = get_u64(h + 8);
    r->txn_id = get_u64(h + 16);
    r->offset = pos;
    r->size = size;
    r->payload_len = plen;
    return size;
}

/* LogRecord is a slots dataclass: its fields are member slots at fixed offsets. Filling them
   directly builds the same object its __init__ would (which sets each field),
   without running a Python-level __init__ per record. ``slot_offsets`` finds the offsets; any
   surprise (not a slots class, a field that is not an object slot) means: call the type. */
static const char *record_fields[9] = {"op",   "woid",    "txn_id",   "file_id", "offset",
                                       "size", "payload", "salvaged", "sealed"};

static int
slot_offsets_of(PyObject *type, const char *const *fields, int nfields, Py_ssize_t *offs)
{
    if (!PyType_Check(type))
        return 0;
    PyTypeObject *tp = (PyTypeObject *)type;
    if (tp->tp_init == NULL || tp->tp_alloc == NULL)
        return 0;
    for (int i = 0; i < nfields; i++) {
        PyObject *d = PyDict_GetItemString(tp->tp_dict, fields[i]);
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type))
            return 0;
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY))
            return 0;
        offs[i] = m->offset;
    }
    return 1;
}

static int
slot_offsets(PyObject *type, Py_ssize_t *offs)
{
    return slot_offsets_of(type, record_fields, 9, offs);
}

/* The ints a run of records repeats (a transaction's id, an event size), kept from the last record. */
typedef struct {
    uint64_t txn_id;
    Py_ssize_t size;
    PyObject *txn_obj, *size_obj;
} int_cache;

static PyObject *
cached_u64(PyObject **slot, uint64_t *have, uint64_t v)
{
    if (*slot == NULL || *have != v) {
        PyObject *o = PyLong_FromUnsignedLongLong(v);
        if (o == NULL)
            return NULL;
        Py_XSETREF(*slot, o);
        *have = v;
    }
    Py_INCREF(*slot);
    return *slot;
}

static PyObject *
cached_ssize(PyObject **slot, Py_ssize_t *have, Py_ssize_t v)
{
    if (*slot == NULL || *have != v) {
        PyObject *o = PyLong_FromSsize_t(v);
        if (o == NULL)
            return NULL;
        Py_XSETREF(*slot, o);
        *have = v;
    }
    Py_INCREF(*slot);
    return *slot;
}

/* An instance of the frozen, slotted dataclass ``type`` (a record, a run) whose fields are
   argv[0..n-1] (all of them, in order). With ``offs`` (the slots' offsets, checked by
   the caller) the slots are filled directly, without calling its __init__; without, the type is
   called. The instance holds no container of objects, so it is untracked by the cyclic GC. */
static PyObject *
new_frozen(PyObject *type, const Py_ssize_t *offs, PyObject *const *argv, int n)
{
    PyObject *res;
    if (offs != NULL) {
        PyTypeObject *tp = (PyTypeObject *)type;
        res = tp->tp_alloc(tp, 0);
        if (res == NULL)
            return NULL;
        for (int i = 0; i < n; i++) {
            Py_INCREF(argv[i]);
            *(PyObject **)((char *)res + offs[i]) = argv[i];
        }
    }
    else {
        res = PyObject_Vectorcall(type, argv, (size_t)n, NULL);
        if (res == NULL)
            return NULL;
    }
    if (PyObject_IS_GC(res) && PyObject_GC_IsTracked(res))
        PyObject_GC_UnTrack(res);
    return res;
}

static PyObject *
make_record(PyObject *type, const Py_ssize_t *offs, const unsigned char *b, const pending_rec *r, PyObject *fid,
            Py_ssize_t base, PyObject *empty, int_cache *cache)
{
    PyObject *argv[9] = {NULL};
    PyObject *res = NULL;
    argv[0] = PyLong_FromLong(r->op);
    argv[1] = PyLong_FromUnsignedLongLong(r->woid);
    argv[2] = cached_u64(&cache->txn_obj, &cache->txn_id, r->txn_id);
    argv[3] = fid;
    argv[4] = PyLong_FromSsize_t(r->offset + base);
    argv[5] = cached_ssize(&cache->size_obj, &cache->size, r->size);
    if (r->op == OP_PUT) {
        Py_INCREF(empty);
        argv[6] = empty;
    } else {
        argv[6] = PyBytes_FromStringAndSize((const char *)b + r->offset + HEADER_LEN, r->payload_len);
    }
    argv[7] = Py_False; /* salvaged: a walk keeps verified batches only */
    /* sealed: a MARK's (a PUT's flag is read with its payload; scan.LogRecord) */
    argv[8] = r->op != OP_PUT && r->flags == FLAG_SEALED ? Py_True : Py_False;
    /* A record holds only ints, bytes and bools, and is frozen: it can never be part of a
       reference cycle. Untracked, the cyclic GC does not walk the million records a recovery
       holds over and over as their list grows (that walk was ~0.85 s of a 2.4 s replay of 1M
       events). */
    if (argv[0] && argv[1] && argv[2] && argv[4] && argv[5] && argv[6])
        res = new_frozen(type, offs, argv, 9);
    Py_XDECREF(argv[0]);
    Py_XDECREF(argv[1]);
    Py_XDECREF(argv[2]);
    Py_XDECREF(argv[4]);
    Py_XDECREF(argv[5]);
    Py_XDECREF(argv[6]);
    return res;
}

/* Append the record of ``r`` to ``records``; -1 with an exception set on failure. */
static int
append_record(PyObject *records, PyObject *type, const Py_ssize_t *offs, const unsigned char *b, const pending_rec *r,
              PyObject *fid, Py_ssize_t base, PyObject *empty, int_cache *cache)
{
    return append_new(records, make_record(type, offs, b, r, fid, base, empty, cache));
}

/* Compact mode (recovery): the PUTs of a verified batch are not records. Their offsets and frame
   sizes go to two int64 columns (the caller's array("q") pair, extended once at the end), and one
   scan.PutRun stands for each stretch of one transaction's consecutive PUTs inside one batch:
   (op=PUT_RUN, first woid, txn id, file id, start index in the columns, count, offsets, sizes,
   salvaged=False), appended to ``records`` where the stretch ends, before the next record. The
   twin is scan._compact. */
#define OP_PUT_RUN 0x100 /* scan.PUT_RUN */
static const char *run_fields[9] = {"op", "woid", "txn_id", "file_id", "start", "count", "offsets", "sizes", "salvaged"};

typedef struct {
    PyObject *type, *offsets, *sizes, *fid;
    int direct;
    Py_ssize_t offs[9];
    Py_ssize_t base_index; /* len(offsets) when the walk started */
    int64_t *off_col, *size_col;
    Py_ssize_t n, cap;
} run_cols;

static int
cols_push(run_cols *c, int64_t off, int64_t size)
{
    if (c->n == c->cap) {
        Py_ssize_t ncap = c->cap ? c->cap * 2 : 4096;
        int64_t *a = PyMem_Realloc(c->off_col, sizeof(int64_t) * (size_t)ncap);
        if (a == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->off_col = a;
        int64_t *z = PyMem_Realloc(c->size_col, sizeof(int64_t) * (size_t)ncap);
        if (z == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->size_col = z;
        c->cap = ncap;
    }
    c->off_col[c->n] = off;
    c->size_col[c->n] = size;
    c->n++;
    return 0;
}

/* Append the run of ``count`` PUTs that starts at column index ``start`` (local to this walk). */
static int
emit_run(run_cols *c, PyObject *records, uint64_t woid, uint64_t txn_id, Py_ssize_t start, Py_ssize_t count)
{
    PyObject *argv[9] = {NULL};
    PyObject *res = NULL;
    argv[0] = PyLong_FromLong(OP_PUT_RUN);
    argv[1] = PyLong_FromUnsignedLongLong(woid);
    argv[2] = PyLong_FromUnsignedLongLong(txn_id);
    argv[3] = c->fid;
    argv[4] = PyLong_FromSsize_t(c->base_index + start);
    argv[5] = PyLong_FromSsize_t(count);
    argv[6] = c->offsets;
    argv[7] = c->sizes;
    argv[8] = Py_False; /* salvaged */
    /* ints and two arrays (which hold no objects), frozen: never part of a cycle */
    if (argv[0] && argv[1] && argv[2] && argv[4] && argv[5])
        res = new_frozen(c->type, c->direct ? c->offs : NULL, argv, 9);
    Py_XDECREF(argv[0]);
    Py_XDECREF(argv[1]);
    Py_XDECREF(argv[2]);
    Py_XDECREF(argv[4]);
    Py_XDECREF(argv[5]);
    return append_new(records, res);
}

/* Extend one array("q") column with ``n`` int64s (array's frombytes: one call, one copy). */
static int
extend_column(PyObject *arr, const int64_t *v, Py_ssize_t n)
{
    PyObject *b = PyBytes_FromStringAndSize((const char *)v, n * (Py_ssize_t)sizeof(int64_t));
    if (b == NULL)
        return -1;
    PyObject *r = PyObject_CallMethod(arr, "frombytes", "O", b);
    Py_DECREF(b);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* After a full replay the heap holds the freed scan (file columns, records of other ops, the
   vouching checkpoint) below the queue's columns, which grew last: glibc cannot give that back
   on its own (it trims only the top of the heap), and RSS stayed at 2-3x the queue. */
#if defined(__GLIBC__)
#include <malloc.h>
#endif

static PyObject *
sp_trim_heap(PyObject *self, PyObject *noargs)
{
#if defined(__GLIBC__)
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = malloc_trim(0);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(r);
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *
sp_scan_batches(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, base;
    unsigned long seed_l;
    int kind;
    unsigned long long max_payload, batch_last_woid;
    PyObject *fid, *type, *records;
    PyObject *run_type = Py_None, *run_offsets = NULL, *run_sizes = NULL;
    if (!PyArg_ParseTuple(args, "y*nkiKKnOOO!|OOO", &view, &pos, &seed_l, &kind, &max_payload, &batch_last_woid,
                          &base, &fid, &type, &PyList_Type, &records, &run_type, &run_offsets, &run_sizes))
        return NULL;
    run_cols cols = {NULL, NULL, NULL, NULL, 0, {0}, 0, NULL, NULL, 0, 0};
    int compact = run_type != Py_None;
    if (compact) {
        Py_ssize_t lo = run_offsets ? PyObject_Size(run_offsets) : -1;
        Py_ssize_t ls = run_sizes ? PyObject_Size(run_sizes) : -1;
        if (lo < 0 || ls != lo) {
            PyBuffer_Release(&view);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a run type needs two columns of the same length");
            return NULL;
        }
        cols.type = run_type;
        cols.offsets = run_offsets;
        cols.sizes = run_sizes;
        cols.fid = fid;
        cols.direct = slot_offsets_of(run_type, run_fields, 9, cols.offs);
        cols.base_index = lo;
    }
    extend_fn ext = extend_for(kind);
    if (ext == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint32_t seed = (uint32_t)seed_l;
    Py_ssize_t offs[9];
    int direct = slot_offsets(type, offs);
    int_cache cache = {0, 0, NULL, NULL};
    const unsigned char *b = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len;
    Py_ssize_t g = pos;
    uint64_t last = batch_last_woid; /* the last write-order id of the verified prefix */
    Py_ssize_t cap = 256, np = 0;
    pending_rec *pend = PyMem_Malloc(sizeof(pending_rec) * (size_t)cap);
    PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
    int failed = 0;
    if (pend == NULL || empty == NULL) {
        PyErr_NoMemory();
        failed = 1;
        goto out;
    }
    if (g < 0)
        goto out;
    for (;;) {
        /* one batch: records from g up to a BATCH_END that verifies it */
        Py_ssize_t p = g;
        uint64_t prev = last;
        np = 0;
        pending_rec r;
        int ok = 0;
        while (p < n) {
            Py_ssize_t size = decode_frame(b, n, p, seed, ext, max_payload, &r);
            if (size == 0)
                break;
            if (np == 0 ? !(r.woid > prev) : (prev == UINT64_MAX || r.woid != prev + 1))
                break;
            if (r.op == OP_BATCH_END) {
                if (r.payload_len != BATCH_END_PAYLOAD || np == 0)
                    break;
                const unsigned char *q = b + p + HEADER_LEN;
                uint64_t bstart = get_u64(q), first_w = get_u64(q + 16), last_w = get_u64(q + 24);
                uint32_t blen = get_u32(q + 8), bcrc = get_u32(q + 12);
                if (bstart != (uint64_t)(g + base) || (Py_ssize_t)blen != p - g)
                    break;
                if (ext(seed, b + g, (size_t)(p - g)) != bcrc)
                    break;
                if (first_w != pend[0].woid || last_w != pend[np - 1].woid)
                    break;
                p += size;
                last = r.woid;
                ok = 1;
                break;
            }
            if (np == cap) {
                Py_ssize_t ncap = cap * 2;
                pending_rec *grown = PyMem_Realloc(pend, sizeof(pending_rec) * (size_t)ncap);
                if (grown == NULL) {
                    PyErr_NoMemory();
                    failed = 1;
                    goto out;
                }
                pend = grown;
                cap = ncap;
            }
            pend[np++] = r;
            prev = r.woid;
            p += size;
        }
        if (!ok)
            break;
        if (compact) {
            /* a run: PUTs i0..i-1 of one transaction; runs end at a batch's end and at any other record */
            Py_ssize_t i0 = -1, c0 = 0;
            for (Py_ssize_t i = 0; i <= np; i++) {
                int put = i < np && pend[i].op == OP_PUT;
                if (i0 >= 0 && !(put && pend[i].txn_id == pend[i0].txn_id)) {
                    if (emit_run(&cols, records, pend[i0].woid, pend[i0].txn_id, c0, i - i0) < 0) {
                        failed = 1;
                        goto out;
                    }
                    i0 = -1;
                }
                if (i == np)
                    break;
                if (put) {
                    if (i0 < 0) {
                        i0 = i;
                        c0 = cols.n;
                    }
                    if (cols_push(&cols, (int64_t)(pend[i].offset + base), (int64_t)pend[i].size) < 0) {
                        failed = 1;
                        goto out;
                    }
                    continue;
                }
                if (append_record(records, type, direct ? offs : NULL, b, &pend[i], fid, base, empty, &cache) < 0) {
                    failed = 1;
                    goto out;
                }
            }
            g = p;
            continue;
        }
        for (Py_ssize_t i = 0; i < np; i++) {
            if (append_record(records, type, direct ? offs : NULL, b, &pend[i], fid, base, empty, &cache) < 0) {
                failed = 1;
                goto out;
            }
        }
        g = p;
    }
out:
    if (!failed && cols.n > 0) {
        /* the runs appended above point into these rows; both columns grow together */
        if (extend_column(cols.offsets, cols.off_col, cols.n) < 0 || extend_column(cols.sizes, cols.size_col, cols.n) < 0)
            failed = 1;
    }
    PyMem_Free(cols.off_col);
    PyMem_Free(cols.size_col);
    Py_XDECREF(cache.txn_obj);
    Py_XDECREF(cache.size_obj);
    PyMem_Free(pend);
    Py_XDECREF(empty);
    PyBuffer_Release(&view);
    if (failed)
        return NULL;
    return Py_BuildValue("(nK)", g, (unsigned long long)last);
}

/* ------------------------------------------------------------------------ */
/* decode_puts: the records a take reads from disk, verified and decoded in one call */

/* A FormatError-like marker (not raised): error_type(offset, reason); steals ``reason``. */
static PyObject *
make_marker(PyObject *error_type, Py_ssize_t offset, PyObject *reason)
{
    if (reason == NULL)
        return NULL;
    PyObject *r = PyObject_CallFunction(error_type, "nO", offset, reason);
    Py_DECREF(reason);
    return r;
}

/* Decode one header's key or value as format.decode_event does (UTF-8, surrogatepass).
   Returns the str, or NULL with *bad set (and no error) when the bytes are not valid. */
static PyObject *
decode_header_text(const unsigned char *p, Py_ssize_t n, int *bad)
{
    PyObject *s = PyUnicode_DecodeUTF8((const char *)p, n, "surrogatepass");
    if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear();
        *bad = 1;
    }
    return s;
}

/* The twin of format.decode_event on ``n`` bytes at ``p``: (body, headers), or an event_error
   marker; NULL only on a Python error (memory). Every length is checked before it is used. */
static PyObject *
decode_event_c(const unsigned char *p, Py_ssize_t n, PyObject *event_error)
{
    if (n < 4)
        return make_marker(event_error, 0, PyUnicode_FromString("event payload shorter than its header count"));
    uint32_t count = get_u32(p);
    if (count == 0) {
        PyObject *body = PyBytes_FromStringAndSize((const char *)p + 4, n - 4);
        if (body == NULL)
            return NULL;
        PyObject *hd = PyDict_New();
        if (hd == NULL) {
            Py_DECREF(body);
            return NULL;
        }
        return Py_BuildValue("(NN)", body, hd);
    }
    if ((Py_ssize_t)count > (n - 4) / 8)
        return make_marker(event_error, 0,
                           PyUnicode_FromFormat("event header count %lu exceeds the payload", (unsigned long)count));
    PyObject *hd = PyDict_New();
    if (hd == NULL)
        return NULL;
    Py_ssize_t pos = 4;
    for (uint32_t i = 0; i < count; i++) {
        if (pos + 8 > n) {
            Py_DECREF(hd);
            return make_marker(event_error, pos, PyUnicode_FromString("event header runs past the payload"));
        }
        uint32_t kl = get_u32(p + pos), vl = get_u32(p + pos + 4);
        pos += 8;
        if ((uint64_t)pos + kl + vl > (uint64_t)n) {
            Py_DECREF(hd);
            return make_marker(event_error, pos, PyUnicode_FromString("event header runs past the payload"));
        }
        int bad = 0;
        PyObject *k = decode_header_text(p + pos, (Py_ssize_t)kl, &bad);
        PyObject *v = k != NULL ? decode_header_text(p + pos + kl, (Py_ssize_t)vl, &bad) : NULL;
        if (k == NULL || v == NULL) {
            Py_XDECREF(k);
            Py_DECREF(hd);
            if (bad)
                return make_marker(event_error, pos, PyUnicode_FromString("event header is not valid UTF-8"));
            return NULL;
        }
        int rc = PyDict_SetItem(hd, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc < 0) {
            Py_DECREF(hd);
            return NULL;
        }
        pos += (Py_ssize_t)kl + (Py_ssize_t)vl;
    }
    PyObject *body = PyBytes_FromStringAndSize((const char *)p + pos, n - pos);
    if (body == NULL) {
        Py_DECREF(hd);
        return NULL;
    }
    return Py_BuildValue("(NN)", body, hd);
}

/* One record, as format._decode_puts handles it: the ``size`` bytes at ``off`` (fewer where the
   buffer ends) must be exactly one valid record; then its payload, decoded or not. */
static PyObject *
decode_put_c(const unsigned char *b, Py_ssize_t len, Py_ssize_t off, Py_ssize_t size, uint32_t seed, extend_fn ext,
             unsigned long long max_payload, PyObject *max_obj, int decode, PyObject *frame_error,
             PyObject *event_error)
{
    Py_ssize_t avail = off < len ? len - off : 0;
    if (size < avail)
        avail = size > 0 ? size : 0;
    const unsigned char *h = b + (avail > 0 ? off : 0); /* never read when avail is 0 */
    if (avail < HEADER_LEN) {
        if (avail > 0 && (h[0] < 1 || h[0] > OP_MAX))
            return make_marker(frame_error, 0, PyUnicode_FromFormat("invalid record op %d", (int)h[0]));
        return make_marker(frame_error, 0, PyUnicode_FromString("record is shorter than expected"));
    }
    unsigned char op = h[0], flags = h[1];
    if (op < 1 || op > OP_MAX)
        return make_marker(frame_error, 0, PyUnicode_FromFormat("invalid record op %d", (int)op));
    if (h[2] != 0 || h[3] != 0 || !FLAGS_OK(op, flags))
        return make_marker(frame_error, 1, PyUnicode_FromString("reserved record bits are set"));
    uint32_t plen = get_u32(h + 4);
    if ((unsigned long long)plen > max_payload)
        return make_marker(frame_error, 4,
                           PyUnicode_FromFormat("record payload length %lu exceeds the limit %S", (unsigned long)plen,
                                                max_obj));
    int bad_len = payload_len_check(op, flags, plen);
    if (bad_len == 1)
        return make_marker(frame_error, 4, payload_len_reason(op, plen));
    if (bad_len == 2)
        return make_marker(frame_error, 4,
                           PyUnicode_FromFormat("take payload length %lu does not hold whole ranges", (unsigned long)plen));
    if (bad_len == 3) {
        int grow = flags == FLAG_SEALED ? ENC_TAG_LEN : 0;
        return make_marker(frame_error, 4,
                           PyUnicode_FromFormat("mark payload length %lu is not between %d and %d", (unsigned long)plen,
                                                MARK_MIN + grow, MARK_MAX + grow));
    }
    Py_ssize_t rsize = HEADER_LEN + (Py_ssize_t)plen + (-(Py_ssize_t)plen & 7);
    if (avail < rsize)
        return make_marker(frame_error, 0, PyUnicode_FromString("record is shorter than expected"));
    if (take_count_bad(op, h + HEADER_LEN, plen))
        return make_marker(frame_error, 4,
                           PyUnicode_FromFormat("take payload length %lu does not match its range count %lu",
                                                (unsigned long)plen, (unsigned long)get_u32(h + HEADER_LEN)));
    uint32_t c = ext(seed, h, 24);
    c = ext(c, h + HEADER_LEN, plen);
    if (c != get_u32(h + 24) || get_u32(h + 28) != 0)
        return make_marker(frame_error, 0, PyUnicode_FromString("record checksum mismatch"));
    if (rsize != size)
        return make_marker(frame_error, 0, PyUnicode_FromString("record is shorter than expected"));
    if (!decode || flags == FLAG_SEALED)
        return PyBytes_FromStringAndSize((const char *)h + HEADER_LEN, (Py_ssize_t)plen);
    return decode_event_c(h + HEADER_LEN, (Py_ssize_t)plen, event_error);
}

static PyObject *
sp_decode_puts(PyObject *self, PyObject *args)
{
    Py_buffer view;
    PyObject *offsets, *sizes, *max_obj, *frame_error, *event_error;
    unsigned long seed_l;
    int kind, decode;
    if (!PyArg_ParseTuple(args, "y*OOkiOpOO", &view, &offsets, &sizes, &seed_l, &kind, &max_obj, &decode,
                          &frame_error, &event_error))
        return NULL;
    PyObject *out = NULL, *offs = NULL, *szs = NULL;
    extend_fn ext = pick_extend(kind);
    if (ext == NULL) {
        /* format._decode_puts raises FormatError(0, ...) here */
        PyObject *e = make_marker(frame_error, 0, PyUnicode_FromFormat("unknown checksum algorithm %d", kind));
        if (e != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(e), e);
            Py_DECREF(e);
        }
        goto done;
    }
    offs = PySequence_Fast(offsets, "offsets must be a sequence");
    szs = offs ? PySequence_Fast(sizes, "sizes must be a sequence") : NULL;
    if (szs == NULL)
        goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(offs);
    if (PySequence_Fast_GET_SIZE(szs) != count) {
        PyErr_SetString(PyExc_ValueError, "offsets and sizes differ in length");
        goto done;
    }
    if (!PyLong_Check(max_obj)) {
        PyErr_SetString(PyExc_TypeError, "max_payload must be an int");
        goto done;
    }
    int overflow = 0;
    long long max_ll = PyLong_AsLongLongAndOverflow(max_obj, &overflow);
    if (max_ll == -1 && PyErr_Occurred())
        goto done;
    if (overflow < 0 || (overflow == 0 && max_ll < 0)) {
        PyErr_SetString(PyExc_ValueError, "max_payload must not be negative");
        goto done;
    }
    /* above every u32 length when it overflows: nothing exceeds it */
    unsigned long long max_payload = overflow > 0 ? ~0ULL : (unsigned long long)max_ll;
    const unsigned char *b = (const unsigned char *)view.buf;
    out = PyList_New(count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        /* error_type and event_error are Python code: never trust a list's length across them */
        if (i >= PySequence_Fast_GET_SIZE(offs) || i >= PySequence_Fast_GET_SIZE(szs)) {
            PyErr_SetString(PyExc_RuntimeError, "offsets or sizes changed size during decode_puts");
            goto fail;
        }
        Py_ssize_t off = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(offs, i));
        if (off == -1 && PyErr_Occurred())
            goto fail;
        Py_ssize_t size = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(szs, i));
        if (size == -1 && PyErr_Occurred())
            goto fail;
        if (off < 0) {
            PyErr_Format(PyExc_ValueError, "negative record offset %zd", off);
            goto fail;
        }
        PyObject *r = decode_put_c(b, view.len, off, size, (uint32_t)seed_l, ext, max_payload, max_obj, decode,
                                   frame_error, event_error);
        if (r == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, r);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(offs);
    Py_XDECREF(szs);
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------------------------ */

/* take_runs(entries) -> (ranges, file_runs) or None: a transaction's takes grouped for its commit,
   the twin of channel._ranges(sorted(positions)) and channel._file_runs(entries). ``entries`` is a
   list of (position, file_id, offset, size) tuples. When the positions strictly ascend (the usual
   case) it returns ``ranges``, [(first, count)] of consecutive positions, and ``file_runs``,
   [(file_id, first, count)] of consecutive positions in one file; otherwise (or for anything
   but such tuples of ints) None, and the caller takes the Python path. */
static int
append_pair(PyObject *list, long long a, long long b)
{
    return append_new(list, Py_BuildValue("(LL)", a, b));
}

static int
append_triple(PyObject *list, PyObject *fid, long long a, long long b)
{
    return append_new(list, Py_BuildValue("(OLL)", fid, a, b));
}

static PyObject *
sp_take_runs(PyObject *self, PyObject *entries)
{
    if (!PyList_Check(entries)) {
        PyErr_SetString(PyExc_TypeError, "take_runs: entries must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(entries);
    PyObject *ranges = PyList_New(0), *fruns = PyList_New(0);
    if (ranges == NULL || fruns == NULL)
        goto fail;
    long long rfirst = 0, rcount = 0, ffirst = 0, fcount = 0, prev = 0, ffid_v = 0;
    PyObject *ffid = NULL; /* borrowed from the entry that began the file run */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(entries, i);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 4)
            goto python;
        PyObject *po = PyTuple_GET_ITEM(e, 0), *fo = PyTuple_GET_ITEM(e, 1);
        if (!PyLong_CheckExact(po) || !PyLong_CheckExact(fo))
            goto python;
        int of1 = 0, of2 = 0;
        long long p = PyLong_AsLongLongAndOverflow(po, &of1);
        long long f = PyLong_AsLongLongAndOverflow(fo, &of2);
        if (of1 || of2 || p == LLONG_MAX)
            goto python;
        if (i > 0 && p <= prev)
            goto python; /* not strictly ascending */
        if (i > 0 && p == prev + 1) {
            rcount++;
            if (f == ffid_v) {
                fcount++;
            } else {
                if (append_triple(fruns, ffid, ffirst, fcount) < 0)
                    goto fail;
                ffid = fo, ffid_v = f, ffirst = p, fcount = 1;
            }
        } else {
            if (i > 0 && (append_pair(ranges, rfirst, rcount) < 0 || append_triple(fruns, ffid, ffirst, fcount) < 0))
                goto fail;
            rfirst = p, rcount = 1;
            ffid = fo, ffid_v = f, ffirst = p, fcount = 1;
        }
        prev = p;
    }
    if (n > 0 && (append_pair(ranges, rfirst, rcount) < 0 || append_triple(fruns, ffid, ffirst, fcount) < 0))
        goto fail;
    return Py_BuildValue("(NN)", ranges, fruns);
python:
    Py_DECREF(ranges);
    Py_DECREF(fruns);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(ranges);
    Py_XDECREF(fruns);
    return NULL;
}

/* take_slots(cls, bodies, headers, a, m, first) -> (events, nbytes): take a stretch of a cache run,
   the twin of takes.take_slots. Builds cls((bodies[a + i], headers[a + i], first + i)) for i < m,
   clears bodies[a .. a + m) to None (each body's reference moves into its event) and returns the
   events with the sum of the bodies' lengths. Checks everything before changing anything: a stretch
   past either list's end is a ValueError, a slot already cleared a TypeError (len(None), as in
   the twin). */
static PyObject *
sp_take_slots(PyObject *self, PyObject *args)
{
    PyObject *cls, *bodies, *headers;
    Py_ssize_t a, m, first;
    if (!PyArg_ParseTuple(args, "O!O!O!nnn", &PyType_Type, &cls, &PyList_Type, &bodies, &PyList_Type, &headers, &a,
                          &m, &first))
        return NULL;
    PyTypeObject *tp = (PyTypeObject *)cls;
    if (!PyType_IsSubtype(tp, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "take_slots: cls must be a tuple subclass");
        return NULL;
    }
    if (a < 0 || m < 0 || a > PyList_GET_SIZE(bodies) - m || a > PyList_GET_SIZE(headers) - m) {
        PyErr_SetString(PyExc_ValueError, "take_slots: the stretch is not inside the run");
        return NULL;
    }
    if (m > 0 && first > PY_SSIZE_T_MAX - m) {
        PyErr_SetString(PyExc_OverflowError, "take_slots: positions overflow");
        return NULL;
    }
    Py_ssize_t nbytes = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *b = PyList_GET_ITEM(bodies, a + i);
        Py_ssize_t k = PyBytes_CheckExact(b) ? PyBytes_GET_SIZE(b) : PyObject_Size(b);
        if (k < 0)
            return NULL;
        nbytes += k;
    }
    PyObject *out = PyList_New(m);
    if (out == NULL)
        return NULL;
    PyObject **evs = ((PyListObject *)out)->ob_item;
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *pos = PyLong_FromSsize_t(first + i);
        PyObject *ev = pos == NULL ? NULL : tp->tp_alloc(tp, 3);
        if (ev == NULL) {
            Py_XDECREF(pos);
            Py_DECREF(out); /* the slots are untouched: nothing was cleared yet */
            return NULL;
        }
        PyObject *h = PyList_GET_ITEM(headers, a + i);
        Py_INCREF(h);
        PyTuple_SET_ITEM(ev, 1, h);
        PyTuple_SET_ITEM(ev, 2, pos);
        PyTuple_SET_ITEM(ev, 0, NULL);
        evs[i] = ev;
    }
    /* Everything is allocated: move each body's reference from its slot into its event. (An
       allocation can run the garbage collector, and with it arbitrary code: check the list again.) */
    if (a > PyList_GET_SIZE(bodies) - m) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_RuntimeError, "take_slots: the run changed while its events were built");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject **slot = &((PyListObject *)bodies)->ob_item[a + i];
        PyTuple_SET_ITEM(evs[i], 0, *slot);
        Py_INCREF(Py_None);
        *slot = Py_None;
    }
    return Py_BuildValue("(Nn)", out, nbytes);
}

/* int64_range(first, n) -> bytes: first, first + 1, ..., first + n - 1 as native int64s, for
   array("q").frombytes (the queue's positions column; its twin is fromlist(range)). */
static PyObject *
sp_int64_range(PyObject *self, PyObject *args)
{
    long long first;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Ln", &first, &n))
        return NULL;
    if (n < 0 || n > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "int64_range: bad count");
        return NULL;
    }
    if (n > 0 && first > LLONG_MAX - (n - 1)) {
        PyErr_SetString(PyExc_OverflowError, "int64_range: values past int64");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL)
        return NULL;
    int64_t *v = (int64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++)
        v[i] = (int64_t)(first + i);
    return out;
}

/* frames_size(payloads, extra) -> int: the bytes the PUT frames of ``payloads`` occupy when each
   stored payload is ``extra`` bytes longer than given (a prefix, a sealing tag): the sum of
   record_size(len(p) + extra). The twin of format.frames_size's Python loop. */
static PyObject *
sp_frames_size(PyObject *self, PyObject *args)
{
    PyObject *payloads;
    Py_ssize_t extra;
    if (!PyArg_ParseTuple(args, "On", &payloads, &extra))
        return NULL;
    PyObject *seq = PySequence_Fast(payloads, "payloads must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long long total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *p = items[i];
        Py_ssize_t k = PyBytes_CheckExact(p) ? PyBytes_GET_SIZE(p) : PyObject_Size(p);
        if (k < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        long long n = (long long)k + extra;
        total += (n + HEADER_LEN + 7) & ~7LL;
    }
    Py_DECREF(seq);
    return PyLong_FromLongLong(total);
}

/* close_batch(seed, kind, parts, start, first_woid, woid) -> bytes: the BATCH_END frame that closes
   a batch: its payload (start, body length, checksum over every byte of ``parts`` seeded with
   ``seed``, first_woid, woid - 1) framed with write-order id ``woid``. The twin of
   format._RecordEncoder.close_batch. */
static PyObject *
sp_close_batch(PyObject *self, PyObject *args)
{
    unsigned long seed_l;
    int kind;
    PyObject *parts, *start_o, *first_o, *woid_o;
    if (!PyArg_ParseTuple(args, "kiO!OOO", &seed_l, &kind, &PyList_Type, &parts, &start_o, &first_o, &woid_o))
        return NULL;
    /* checked conversions: a negative or too large value is an OverflowError, never wrapped */
    unsigned long long woid = PyLong_AsUnsignedLongLong(woid_o);
    if (PyErr_Occurred())
        return NULL;
    if (woid == 0) {
        PyErr_SetString(PyExc_ValueError, "close_batch: a batch ends after its first record");
        return NULL;
    }
    unsigned long long start = PyLong_AsUnsignedLongLong(start_o);
    unsigned long long first_woid = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(first_o);
    if (PyErr_Occurred())
        return NULL;
    extend_fn ext = extend_for(kind);
    if (ext == NULL)
        return NULL;
    uint32_t body_crc = (uint32_t)seed_l;
    unsigned long long body_len = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(parts); i++) {
        PyObject *part = PyList_GET_ITEM(parts, i);
        if (PyBytes_Check(part)) {
            body_crc = ext(body_crc, (const unsigned char *)PyBytes_AS_STRING(part), (size_t)PyBytes_GET_SIZE(part));
            body_len += (unsigned long long)PyBytes_GET_SIZE(part);
            continue;
        }
        /* a view of the writer's frame buffer (encode_column's ``out``): any contiguous buffer */
        Py_buffer pb;
        if (PyObject_GetBuffer(part, &pb, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "close_batch: parts must be bytes-like, not %.100s", Py_TYPE(part)->tp_name);
            return NULL;
        }
        body_crc = ext(body_crc, (const unsigned char *)pb.buf, (size_t)pb.len);
        body_len += (unsigned long long)pb.len;
        PyBuffer_Release(&pb);
    }
    if (body_len > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "close_batch: the batch does not fit a u32 length");
        return NULL;
    }
    /* BATCH_END payload "<QIIQQ": batch_start, batch_len, batch_crc, first_woid, last_woid (32 bytes) */
    PyObject *out = PyBytes_FromStringAndSize(NULL, HEADER_LEN + 32);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    p[0] = OP_BATCH_END;
    p[1] = 0;
    put_u16(p + 2, 0);
    put_u32(p + 4, 32);
    put_u64(p + 8, woid);
    put_u64(p + 16, 0);
    unsigned char *q = p + HEADER_LEN;
    put_u64(q, start);
    put_u32(q + 8, (uint32_t)body_len);
    put_u32(q + 12, body_crc);
    put_u64(q + 16, first_woid);
    put_u64(q + 24, woid - 1);
    uint32_t c = ext((uint32_t)seed_l, p, 24);
    c = ext(c, q, 32);
    put_u32(p + 24, c);
    put_u32(p + 28, 0);
    return out;
}

/* frame_commit1(seed, kind, woid, txn_id, payload, prefix, start, first_position) -> bytes: a whole
   one-event transaction's write in one buffer (the writer's lone-committer path, issue 26): the PUT
   frame of prefix + payload (write-order id woid), the COMMIT frame (woid + 1: first_position, 1
   put, 0 takes) and the BATCH_END frame (woid + 2) closing the two, the batch starting at file
   offset ``start``. The same bytes as add_puts + add(COMMIT) + close_batch (writer._frame_commit1,
   the pure-Python twin). Unsealed payloads only. */
static PyObject *
sp_frame_commit1(PyObject *self, PyObject *args)
{
    unsigned long seed_l;
    int kind;
    PyObject *woid_o, *txn_o, *start_o, *first_o;
    Py_buffer pb, xb;
    if (!PyArg_ParseTuple(args, "kiOOy*y*OO", &seed_l, &kind, &woid_o, &txn_o, &pb, &xb, &start_o, &first_o))
        return NULL;
    PyObject *out = NULL;
    /* checked conversions: a negative or too large value is an OverflowError, never wrapped */
    unsigned long long woid = PyLong_AsUnsignedLongLong(woid_o);
    unsigned long long txn_id = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(txn_o);
    unsigned long long start = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(start_o);
    unsigned long long first = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(first_o);
    extend_fn ext = PyErr_Occurred() ? NULL : extend_for(kind);
    if (ext == NULL)
        goto done;
    if (woid > 0xFFFFFFFFFFFFFFFFull - 2) {
        PyErr_SetString(PyExc_OverflowError, "frame_commit1: woid + 2 does not fit a u64");
        goto done;
    }
    Py_ssize_t n = pb.len + xb.len;
    if ((unsigned long long)n > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "frame_commit1: the payload does not fit a u32 length");
        goto done;
    }
    Py_ssize_t pad = -n & 7;
    Py_ssize_t put_size = HEADER_LEN + n + pad;
    Py_ssize_t body_len = put_size + HEADER_LEN + 16;
    out = PyBytes_FromStringAndSize(NULL, body_len + HEADER_LEN + BATCH_END_PAYLOAD);
    if (out == NULL)
        goto done;
    unsigned char *b = (unsigned char *)PyBytes_AS_STRING(out);
    uint32_t seed = (uint32_t)seed_l;
    /* the PUT */
    unsigned char *p = b;
    p[0] = OP_PUT;
    p[1] = 0;
    put_u16(p + 2, 0);
    put_u32(p + 4, (uint32_t)n);
    put_u64(p + 8, woid);
    put_u64(p + 16, txn_id);
    memcpy(p + HEADER_LEN, xb.buf, (size_t)xb.len);
    memcpy(p + HEADER_LEN + xb.len, pb.buf, (size_t)pb.len);
    memset(p + HEADER_LEN + n, 0, (size_t)pad);
    uint32_t c = ext(seed, p, 24);
    c = ext(c, p + HEADER_LEN, (size_t)n);
    put_u32(p + 24, c);
    put_u32(p + 28, 0);
    /* the COMMIT: "<QII" first_position, 1 put, 0 takes */
    p = b + put_size;
    p[0] = 3; /* format.COMMIT */
    p[1] = 0;
    put_u16(p + 2, 0);
    put_u32(p + 4, 16);
    put_u64(p + 8, woid + 1);
    put_u64(p + 16, txn_id);
    put_u64(p + HEADER_LEN, first);
    put_u32(p + HEADER_LEN + 8, 1);
    put_u32(p + HEADER_LEN + 12, 0);
    c = ext(seed, p, 24);
    c = ext(c, p + HEADER_LEN, 16);
    put_u32(p + 24, c);
    put_u32(p + 28, 0);
    /* the BATCH_END over both: "<QIIQQ" batch_start, batch_len, batch_crc, first_woid, last_woid */
    uint32_t body_crc = ext(seed, b, (size_t)body_len);
    p = b + body_len;
    p[0] = OP_BATCH_END;
    p[1] = 0;
    put_u16(p + 2, 0);
    put_u32(p + 4, BATCH_END_PAYLOAD);
    put_u64(p + 8, woid + 2);
    put_u64(p + 16, 0);
    unsigned char *q = p + HEADER_LEN;
    put_u64(q, start);
    put_u32(q + 8, (uint32_t)body_len);
    put_u32(q + 12, body_crc);
    put_u64(q + 16, woid);
    put_u64(q + 24, woid + 1);
    c = ext(seed, p, 24);
    c = ext(c, q, BATCH_END_PAYLOAD);
    put_u32(p + 24, c);
    put_u32(p + 28, 0);
done:
    PyBuffer_Release(&pb);
    PyBuffer_Release(&xb);
    return out;
}

/* ------------------------------------------------------------------------ */
/* The Arrow read and put paths (filechannel/arrow.py is their caller and holds their twins).

   arrow_verify(buf, offsets, sizes, seed, kind, keyed) -> (ok, spans, error)
       (offsets and sizes: native int64 buffers) checks the records of a segment as
       reader._decode_put does, record by record, and stops at
       the first that fails: ``ok`` records passed, ``spans`` holds (payload start, payload length)
       of each as native int64 pairs, ``error`` is None or (code, reason): code 0 a frame that is
       not a PUT record of exactly that size (reason as format.decode_record gives it), code 1 a
       sealed record and no key (``keyed`` false).
   arrow_events(parts) -> (None, buffers) or ((part, index, code, reason), None)
       decodes the event payloads of each part, (data, spans, count): ``count`` int64 (start,
       length) pairs into ``data``, one after the other (format.decode_event's checks and
       reasons) into the buffers of one set of Arrow arrays: body offsets (int32) and data, map offsets (int32), key offsets
       and data, value offsets and data; headers as a dict would hold them (a repeated key keeps
       its first place and its last value). Code 1 the first event that does not decode; else 2
       the first whose header holds an encoded lone surrogate (valid for decode_event, not UTF-8
       for Arrow); else 3 more than 2 GiB in one column.
   arrow_puts(offsets, data, n, offset, wide, no_headers, headers) -> list or (index, reason)
       the PUT payloads of an Arrow body column (int32 or, ``wide``, int64 offsets): one bytes
       object per row, in one call. With ``headers`` (map offsets, key offsets, key data, value
       offsets, value data, map validity or None; int32 offsets, no slicing): (payloads, bodies,
       dicts), each payload format.encode_event(body, dict) of the row's dict (``no_headers`` for
       an empty or null map); (index, reason) for a header that is not strict UTF-8. */

/* 0: valid UTF-8 under Python's "surrogatepass" (what decode_event accepts); -1 otherwise.
   *sur is set when an encoded surrogate (ED A0..BF xx) occurs: valid there, not strict UTF-8. */
static int
utf8_check(const unsigned char *s, size_t n, int *sur)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            if (n - i < 2 || (s[i + 1] & 0xC0) != 0x80)
                return -1;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (n - i < 3)
                return -1;
            unsigned char c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (c == 0xE0 && c1 < 0xA0))
                return -1;
            if (c == 0xED && c1 >= 0xA0)
                *sur = 1;
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (n - i < 4)
                return -1;
            unsigned char c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80 ||
                (c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 > 0x8F))
                return -1;
            i += 4;
        } else {
            return -1;
        }
    }
    return 0;
}

static PyObject *
sp_arrow_verify(PyObject *self, PyObject *args)
{
    Py_buffer view, ov, sv;
    unsigned long seed_l;
    int kind, keyed;
    if (!PyArg_ParseTuple(args, "y*y*y*kip", &view, &ov, &sv, &seed_l, &kind, &keyed))
        return NULL;
    PyObject *spans = NULL, *err = NULL, *out = NULL;
    extend_fn ext = extend_for(kind);
    if (ext == NULL)
        goto done;
    Py_ssize_t count = ov.len / (Py_ssize_t)sizeof(int64_t);
    if (sv.len / (Py_ssize_t)sizeof(int64_t) != count) {
        PyErr_SetString(PyExc_ValueError, "offsets and sizes differ in length");
        goto done;
    }
    spans = PyBytes_FromStringAndSize(NULL, count * 2 * (Py_ssize_t)sizeof(int64_t));
    if (spans == NULL)
        goto done;
    int64_t *sp = (int64_t *)PyBytes_AS_STRING(spans);
    const unsigned char *b = (const unsigned char *)view.buf;
    Py_ssize_t len = view.len, i;
    uint32_t seed = (uint32_t)seed_l;
    for (i = 0; i < count; i++) {
        int64_t off64, size64;
        memcpy(&off64, (const char *)ov.buf + 8 * i, 8);
        memcpy(&size64, (const char *)sv.buf + 8 * i, 8);
        if (off64 < 0) {
            PyErr_Format(PyExc_ValueError, "negative record offset %lld", (long long)off64);
            goto done;
        }
        Py_ssize_t off = off64 > len ? len : (Py_ssize_t)off64, size = (Py_ssize_t)size64;
        /* format.decode_record(buf, off, ...) on the whole buffer, then reader._decode_put's checks */
        Py_ssize_t avail = len - off;
        const unsigned char *h = b + off;
        PyObject *reason = NULL;
        int code = 0;
        if (avail < HEADER_LEN) {
            if (avail > 0 && (h[0] < 1 || h[0] > OP_MAX))
                reason = PyUnicode_FromFormat("invalid record op %d", (int)h[0]);
            else
                reason = PyUnicode_FromString("no PUT record of the expected size there");
        } else {
            unsigned char op = h[0], flags = h[1];
            uint32_t plen = get_u32(h + 4);
            Py_ssize_t rsize = HEADER_LEN + (Py_ssize_t)plen + (-(Py_ssize_t)plen & 7);
            int bad_len = op >= 1 && op <= OP_MAX ? payload_len_check(op, flags, plen) : 0;
            if (op < 1 || op > OP_MAX)
                reason = PyUnicode_FromFormat("invalid record op %d", (int)op);
            else if (h[2] != 0 || h[3] != 0 || !FLAGS_OK(op, flags))
                reason = PyUnicode_FromString("reserved record bits are set");
            else if (bad_len == 1)
                reason = payload_len_reason(op, plen);
            else if (bad_len == 2)
                reason = PyUnicode_FromFormat("take payload length %lu does not hold whole ranges", (unsigned long)plen);
            else if (bad_len == 3) {
                int grow = flags == FLAG_SEALED ? ENC_TAG_LEN : 0;
                reason = PyUnicode_FromFormat("mark payload length %lu is not between %d and %d", (unsigned long)plen,
                                              MARK_MIN + grow, MARK_MAX + grow);
            } else if (avail < rsize)
                reason = PyUnicode_FromString("no PUT record of the expected size there");
            else if (take_count_bad(op, h + HEADER_LEN, plen))
                reason = PyUnicode_FromFormat("take payload length %lu does not match its range count %lu",
                                              (unsigned long)plen, (unsigned long)get_u32(h + HEADER_LEN));
            else if (ext(ext(seed, h, 24), h + HEADER_LEN, plen) != get_u32(h + 24) || get_u32(h + 28) != 0)
                reason = PyUnicode_FromString("record checksum mismatch");
            else if (rsize != size || op != OP_PUT)
                reason = PyUnicode_FromString("no PUT record of the expected size there");
            else if (flags == FLAG_SEALED && !keyed) {
                code = 1;
                reason = PyUnicode_FromString("");
            } else {
                sp[2 * i] = (int64_t)(off + HEADER_LEN);
                sp[2 * i + 1] = (int64_t)plen;
                continue;
            }
        }
        if (reason == NULL)
            goto done;
        err = Py_BuildValue("(iN)", code, reason);
        if (err == NULL)
            goto done;
        break;
    }
    if (err == NULL) {
        err = Py_None;
        Py_INCREF(err);
    }
    if (i < count && _PyBytes_Resize(&spans, i * 2 * (Py_ssize_t)sizeof(int64_t)) < 0)
        goto done;
    out = Py_BuildValue("(nNN)", i, spans, err);
    spans = err = NULL;
done:
    Py_XDECREF(spans);
    Py_XDECREF(err);
    PyBuffer_Release(&view);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&sv);
    return out;
}

typedef struct {
    const unsigned char *p;
    uint32_t len;
    uint32_t idx;
} key_ref;

static int
key_ref_cmp(const void *a, const void *b)
{
    const key_ref *x = a, *y = b;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    int c = memcmp(x->p, y->p, x->len);
    if (c)
        return c;
    return x->idx < y->idx ? -1 : (x->idx > y->idx ? 1 : 0);
}

/* Scratch space for one event's headers: their keys and values, and what a dict keeps of them. */
typedef struct {
    Py_ssize_t cap;
    const unsigned char **kp, **vp;
    uint32_t *kl, *vl;
    uint32_t *val_from; /* per kept header: the header whose value it takes (the last of its key) */
    uint8_t *drop, *ksur, *vsur; /* dropped (a later header repeats its key); key, value hold a surrogate */
    key_ref *refs;
    uint32_t kept;
} ev_scratch;

static void
scratch_free(ev_scratch *s)
{
    PyMem_Free(s->kp);
    PyMem_Free(s->vp);
    PyMem_Free(s->kl);
    PyMem_Free(s->vl);
    PyMem_Free(s->val_from);
    PyMem_Free(s->drop);
    PyMem_Free(s->ksur);
    PyMem_Free(s->vsur);
    PyMem_Free(s->refs);
    memset(s, 0, sizeof(*s));
}

static int
scratch_grow(ev_scratch *s, Py_ssize_t n)
{
    if (n <= s->cap)
        return 0;
    Py_ssize_t cap = n < 16 ? 16 : n;
    scratch_free(s);
    s->kp = PyMem_Malloc(cap * sizeof(*s->kp));
    s->vp = PyMem_Malloc(cap * sizeof(*s->vp));
    s->kl = PyMem_Malloc(cap * sizeof(*s->kl));
    s->vl = PyMem_Malloc(cap * sizeof(*s->vl));
    s->val_from = PyMem_Malloc(cap * sizeof(*s->val_from));
    s->drop = PyMem_Malloc(cap * sizeof(*s->drop));
    s->ksur = PyMem_Malloc(cap * sizeof(*s->ksur));
    s->vsur = PyMem_Malloc(cap * sizeof(*s->vsur));
    s->refs = PyMem_Malloc(cap * sizeof(*s->refs));
    if (!s->kp || !s->vp || !s->kl || !s->vl || !s->val_from || !s->drop || !s->ksur || !s->vsur || !s->refs) {
        scratch_free(s);
        PyErr_NoMemory();
        return -1;
    }
    s->cap = cap;
    return 0;
}

/* One event payload, as format.decode_event checks it. Returns 0 and fills ``s`` (its headers, and
   which a dict keeps) and *body; 1 with *reason (a static text or a count message) for an event
   that does not decode; 2 for a header holding an encoded surrogate; -1 on a Python error. */
static int
event_layout(const unsigned char *p, Py_ssize_t n, ev_scratch *s, Py_ssize_t *body, PyObject **reason)
{
    s->kept = 0;
    if (n < 4) {
        *reason = PyUnicode_FromString("event payload shorter than its header count");
        return *reason ? 1 : -1;
    }
    uint32_t count = get_u32(p);
    if (count == 0) {
        *body = 4;
        return 0;
    }
    if ((Py_ssize_t)count > (n - 4) / 8) {
        *reason = PyUnicode_FromFormat("event header count %lu exceeds the payload", (unsigned long)count);
        return *reason ? 1 : -1;
    }
    if (scratch_grow(s, count) < 0)
        return -1;
    Py_ssize_t pos = 4;
    for (uint32_t i = 0; i < count; i++) {
        if (pos + 8 > n) {
            *reason = PyUnicode_FromString("event header runs past the payload");
            return *reason ? 1 : -1;
        }
        uint32_t kl = get_u32(p + pos), vl = get_u32(p + pos + 4);
        pos += 8;
        if ((uint64_t)pos + kl + vl > (uint64_t)n) {
            *reason = PyUnicode_FromString("event header runs past the payload");
            return *reason ? 1 : -1;
        }
        int ks = 0, vs = 0;
        if (utf8_check(p + pos, kl, &ks) < 0 || utf8_check(p + pos + kl, vl, &vs) < 0) {
            *reason = PyUnicode_FromString("event header is not valid UTF-8");
            return *reason ? 1 : -1;
        }
        s->kp[i] = p + pos;
        s->kl[i] = kl;
        s->vp[i] = p + pos + kl;
        s->vl[i] = vl;
        s->drop[i] = 0;
        s->ksur[i] = (uint8_t)ks;
        s->vsur[i] = (uint8_t)vs;
        s->val_from[i] = i;
        pos += (Py_ssize_t)kl + (Py_ssize_t)vl;
    }
    *body = pos;
    s->kept = count;
    if (count > 1) { /* a repeated key: a dict keeps its first place and its last value */
        for (uint32_t i = 0; i < count; i++) {
            s->refs[i].p = s->kp[i];
            s->refs[i].len = s->kl[i];
            s->refs[i].idx = i;
        }
        qsort(s->refs, count, sizeof(key_ref), key_ref_cmp);
        for (uint32_t i = 0; i + 1 < count;) {
            uint32_t j = i + 1;
            while (j < count && s->refs[j].len == s->refs[i].len && memcmp(s->refs[j].p, s->refs[i].p, s->refs[i].len) == 0)
                j++;
            if (j - i > 1) {
                uint32_t first = s->refs[i].idx, last = s->refs[j - 1].idx;
                s->val_from[first] = last;
                for (uint32_t k = i + 1; k < j; k++)
                    s->drop[s->refs[k].idx] = 1;
                s->kept -= j - i - 1;
            }
            i = j;
        }
    }
    for (uint32_t i = 0; i < count; i++) /* a surrogate matters only where the dict keeps it */
        if (!s->drop[i] && (s->ksur[i] || s->vsur[s->val_from[i]]))
            return 2;
    return 0;
}

/* One part of arrow_events: a data buffer and ``count`` (start, length) int64 spans into it. */
typedef struct {
    Py_buffer data, spans;
    Py_ssize_t count;
    int held;
} ev_part;

static PyObject *
sp_arrow_events(PyObject *self, PyObject *args)
{
    PyObject *parts_obj;
    if (!PyArg_ParseTuple(args, "O", &parts_obj))
        return NULL;
    PyObject *out = NULL, *parts_seq = PySequence_Fast(parts_obj, "parts must be a sequence");
    if (parts_seq == NULL)
        return NULL;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(parts_seq);
    ev_part *parts = PyMem_Calloc(np > 0 ? (size_t)np : 1, sizeof(ev_part));
    PyObject *bufs[7] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    ev_scratch s;
    memset(&s, 0, sizeof(s));
    if (parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t q = 0; q < np; q++) {
        ev_part *pt = &parts[q];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(parts_seq, q), "y*y*n;a part is (data, spans, count)", &pt->data,
                              &pt->spans, &pt->count))
            goto done;
        pt->held = 1;
        if (pt->count < 0 || pt->spans.len < pt->count * 2 * (Py_ssize_t)sizeof(int64_t)) {
            PyErr_SetString(PyExc_ValueError, "arrow_events: spans hold fewer than count payloads");
            goto done;
        }
        const int64_t *sp = (const int64_t *)pt->spans.buf;
        for (Py_ssize_t i = 0; i < pt->count; i++)
            if (sp[2 * i] < 0 || sp[2 * i + 1] < 0 || sp[2 * i] + sp[2 * i + 1] > (int64_t)pt->data.len) {
                PyErr_SetString(PyExc_ValueError, "arrow_events: a span lies outside the data");
                goto done;
            }
        total += pt->count;
    }
    /* pass 1: check every event and measure the columns */
    int64_t body_bytes = 0, entries = 0, key_bytes = 0, val_bytes = 0;
    Py_ssize_t sur_part = -1, sur_i = -1;
    for (Py_ssize_t q = 0; q < np; q++) {
        const unsigned char *b = parts[q].data.buf;
        const int64_t *sp = parts[q].spans.buf;
        for (Py_ssize_t i = 0; i < parts[q].count; i++) {
            const unsigned char *p = b + sp[2 * i];
            Py_ssize_t n = (Py_ssize_t)sp[2 * i + 1], body = 0;
            PyObject *reason = NULL;
            int rc = event_layout(p, n, &s, &body, &reason);
            if (rc < 0)
                goto done;
            if (rc == 2) { /* reported only if no later event is damaged: read_segment would raise that */
                if (sur_part < 0) {
                    sur_part = q;
                    sur_i = i;
                }
                continue;
            }
            if (rc > 0) {
                out = reason ? Py_BuildValue("((nniN)O)", q, i, rc, reason, Py_None) : NULL;
                goto done;
            }
            body_bytes += n - body;
            Py_ssize_t nh = s.kept ? (Py_ssize_t)get_u32(p) : 0;
            for (Py_ssize_t k = 0; k < nh; k++) {
                if (s.drop[k])
                    continue;
                entries++;
                key_bytes += s.kl[k];
                val_bytes += s.vl[s.val_from[k]];
            }
        }
    }
    if (sur_part >= 0) {
        out = Py_BuildValue("((nnis)O)", sur_part, sur_i, 2, "", Py_None);
        goto done;
    }
    if (body_bytes > INT32_MAX || key_bytes > INT32_MAX || val_bytes > INT32_MAX || entries > INT32_MAX) {
        out = Py_BuildValue("((nnis)O)", (Py_ssize_t)0, (Py_ssize_t)0, 3, "more than 2 GiB in one column", Py_None);
        goto done;
    }
    Py_ssize_t sizes[7] = {(total + 1) * 4, (Py_ssize_t)body_bytes, (total + 1) * 4, ((Py_ssize_t)entries + 1) * 4,
                           (Py_ssize_t)key_bytes, ((Py_ssize_t)entries + 1) * 4, (Py_ssize_t)val_bytes};
    for (int k = 0; k < 7; k++)
        if ((bufs[k] = PyBytes_FromStringAndSize(NULL, sizes[k])) == NULL)
            goto done;
    int32_t *boff = (int32_t *)PyBytes_AS_STRING(bufs[0]), *moff = (int32_t *)PyBytes_AS_STRING(bufs[2]);
    int32_t *koff = (int32_t *)PyBytes_AS_STRING(bufs[3]), *voff = (int32_t *)PyBytes_AS_STRING(bufs[5]);
    unsigned char *bd = (unsigned char *)PyBytes_AS_STRING(bufs[1]), *kd = (unsigned char *)PyBytes_AS_STRING(bufs[4]);
    unsigned char *vd = (unsigned char *)PyBytes_AS_STRING(bufs[6]);
    int32_t bo = 0, e = 0, ko = 0, vo = 0;
    Py_ssize_t row = 0;
    boff[0] = moff[0] = koff[0] = voff[0] = 0;
    /* pass 2: fill them (every event was checked) */
    for (Py_ssize_t q = 0; q < np; q++) {
        const unsigned char *b = parts[q].data.buf;
        const int64_t *sp = parts[q].spans.buf;
        for (Py_ssize_t i = 0; i < parts[q].count; i++, row++) {
            const unsigned char *p = b + sp[2 * i];
            Py_ssize_t n = (Py_ssize_t)sp[2 * i + 1], body = 4;
            if (get_u32(p) != 0) {
                PyObject *reason = NULL;
                if (event_layout(p, n, &s, &body, &reason) != 0) { /* cannot happen: checked in pass 1 */
                    Py_XDECREF(reason);
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_RuntimeError, "arrow_events: an event changed between passes");
                    goto done;
                }
                Py_ssize_t nh = (Py_ssize_t)get_u32(p);
                for (Py_ssize_t k = 0; k < nh; k++) {
                    if (s.drop[k])
                        continue;
                    uint32_t v = s.val_from[k];
                    memcpy(kd + ko, s.kp[k], s.kl[k]);
                    ko += (int32_t)s.kl[k];
                    memcpy(vd + vo, s.vp[v], s.vl[v]);
                    vo += (int32_t)s.vl[v];
                    e++;
                    koff[e] = ko;
                    voff[e] = vo;
                }
            }
            memcpy(bd + bo, p + body, (size_t)(n - body));
            bo += (int32_t)(n - body);
            boff[row + 1] = bo;
            moff[row + 1] = e;
        }
    }
    out = Py_BuildValue("(O(NNNNNNN))", Py_None, bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5], bufs[6]);
    if (out != NULL)
        memset(bufs, 0, sizeof(bufs));
done:
    for (int k = 0; k < 7; k++)
        Py_XDECREF(bufs[k]);
    scratch_free(&s);
    if (parts != NULL)
        for (Py_ssize_t q = 0; q < np; q++)
            if (parts[q].held) {
                PyBuffer_Release(&parts[q].data);
                PyBuffer_Release(&parts[q].spans);
            }
    PyMem_Free(parts);
    Py_DECREF(parts_seq);
    return out;
}

/* The bytes of row ``i`` of a binary column: its offsets are int32 (or int64, ``wide``). */
static int
arrow_slice(const unsigned char *offs, int wide, Py_ssize_t i, Py_ssize_t data_len, Py_ssize_t *a, Py_ssize_t *b)
{
    int64_t x, y;
    if (wide) {
        memcpy(&x, offs + 8 * i, 8);
        memcpy(&y, offs + 8 * (i + 1), 8);
    } else {
        int32_t x32, y32;
        memcpy(&x32, offs + 4 * i, 4);
        memcpy(&y32, offs + 4 * (i + 1), 4);
        x = x32;
        y = y32;
    }
    if (x < 0 || y < x || y > (int64_t)data_len) {
        PyErr_SetString(PyExc_ValueError, "arrow_puts: an offset lies outside the data buffer");
        return -1;
    }
    *a = (Py_ssize_t)x;
    *b = (Py_ssize_t)y;
    return 0;
}

/* The offsets of rows [offset, offset + n) of a binary column (int32, or int64 when ``wide``);
   NULL with a ValueError naming ``who`` when the buffer holds fewer. */
static const unsigned char *
arrow_rows(const Py_buffer *offs, int wide, Py_ssize_t n, Py_ssize_t offset, const char *who)
{
    Py_ssize_t width = wide ? 8 : 4;
    if (n < 0 || offset < 0 || offs->len / width < offset + n + 1) {
        PyErr_Format(PyExc_ValueError, "%s: the offsets buffer is shorter than the column", who);
        return NULL;
    }
    return (const unsigned char *)offs->buf + width * offset;
}

/* The headers column of arrow_puts and arrow_payload_column, a map<string, string>: the
   6-tuple (map offsets, key offsets, key data, value offsets, value data, validity or None). */
typedef struct {
    Py_buffer b[6]; /* the five buffers, then the validity bitmap when there is one */
    int held;       /* how many of b are held */
    const unsigned char *mo, *valid;
    Py_ssize_t n_keys, n_vals;
} arrow_maps;

/* Hold the buffers of ``headers`` for a column of n rows; -1 with an error when they are not
   that shape (release m either way). */
static int
arrow_maps_open(arrow_maps *m, PyObject *headers, Py_ssize_t n)
{
    m->held = 0;
    if (!PyTuple_Check(headers) || PyTuple_GET_SIZE(headers) != 6) {
        PyErr_SetString(PyExc_TypeError, "arrow_puts: headers must be a 6-tuple of buffers or None");
        return -1;
    }
    for (; m->held < 5; m->held++)
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(headers, m->held), &m->b[m->held], PyBUF_SIMPLE) < 0)
            return -1;
    PyObject *valid_obj = PyTuple_GET_ITEM(headers, 5);
    if (valid_obj != Py_None) {
        if (PyObject_GetBuffer(valid_obj, &m->b[5], PyBUF_SIMPLE) < 0)
            return -1;
        m->held = 6;
        if (m->b[5].len * 8 < n) {
            PyErr_SetString(PyExc_ValueError, "arrow_puts: the validity bitmap is shorter than the column");
            return -1;
        }
    }
    if (m->b[0].len / 4 < n + 1) {
        PyErr_SetString(PyExc_ValueError, "arrow_puts: the map offsets are shorter than the column");
        return -1;
    }
    m->mo = m->b[0].buf;
    m->valid = m->held == 6 ? m->b[5].buf : NULL;
    m->n_keys = m->b[1].len / 4 - 1;
    m->n_vals = m->b[3].len / 4 - 1;
    return 0;
}

static void
arrow_maps_release(arrow_maps *m)
{
    for (int k = 0; k < m->held; k++)
        PyBuffer_Release(&m->b[k]);
    m->held = 0;
}

/* The entries [*x, *y) of row i's map (none for a null map); -1 with a ValueError when they
   lie outside the key or value columns. */
static int
arrow_map_row(const arrow_maps *m, Py_ssize_t i, Py_ssize_t *x, Py_ssize_t *y)
{
    int32_t a, b;
    memcpy(&a, m->mo + 4 * i, 4);
    memcpy(&b, m->mo + 4 * (i + 1), 4);
    if (m->valid != NULL && !(m->valid[i >> 3] >> (i & 7) & 1))
        b = a; /* a null map: no headers */
    if (a < 0 || b < a || b > m->n_keys || b > m->n_vals) {
        PyErr_SetString(PyExc_ValueError, "arrow_puts: a map offset lies outside its entries");
        return -1;
    }
    *x = a;
    *y = b;
    return 0;
}

/* One row's headers as a dict (strict UTF-8, a repeated key keeps its last value); NULL with
   *bad (0 key, 1 value) and no error set when a key or value is not strict UTF-8. */
static PyObject *
arrow_row_dict(const unsigned char *koffs, const unsigned char *kdata, Py_ssize_t klen, const unsigned char *voffs,
               const unsigned char *vdata, Py_ssize_t vlen, Py_ssize_t m0, Py_ssize_t m1, int *bad)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (Py_ssize_t j = m0; j < m1; j++) {
        Py_ssize_t ka, kb, va, vb;
        if (arrow_slice(koffs, 0, j, klen, &ka, &kb) < 0 || arrow_slice(voffs, 0, j, vlen, &va, &vb) < 0)
            goto fail;
        PyObject *k = PyUnicode_DecodeUTF8((const char *)kdata + ka, kb - ka, NULL);
        if (k == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();
                *bad = 0;
            }
            goto fail;
        }
        PyObject *v = PyUnicode_DecodeUTF8((const char *)vdata + va, vb - va, NULL);
        if (v == NULL) {
            Py_DECREF(k);
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                PyErr_Clear();
                *bad = 1;
            }
            goto fail;
        }
        int rc = PyDict_SetItem(d, k, v);
        Py_DECREF(k);
        Py_DECREF(v);
        if (rc < 0)
            goto fail;
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* format.encode_event(body, d): the header block of dict ``d`` (str keys and values), then body. */
static PyObject *
encode_event_dict(PyObject *d, const unsigned char *body, Py_ssize_t body_len)
{
    Py_ssize_t total = 4 + body_len, pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        Py_ssize_t kl, vl;
        if (PyUnicode_AsUTF8AndSize(k, &kl) == NULL || PyUnicode_AsUTF8AndSize(v, &vl) == NULL)
            return NULL;
        total += 8 + kl + vl;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    put_u32(p, (uint32_t)PyDict_GET_SIZE(d));
    p += 4;
    pos = 0;
    while (PyDict_Next(d, &pos, &k, &v)) {
        Py_ssize_t kl, vl;
        const char *ks = PyUnicode_AsUTF8AndSize(k, &kl), *vs = PyUnicode_AsUTF8AndSize(v, &vl);
        put_u32(p, (uint32_t)kl);
        put_u32(p + 4, (uint32_t)vl);
        memcpy(p + 8, ks, (size_t)kl);
        memcpy(p + 8 + kl, vs, (size_t)vl);
        p += 8 + kl + vl;
    }
    memcpy(p, body, (size_t)body_len);
    return out;
}

static PyObject *
sp_arrow_puts(PyObject *self, PyObject *args)
{
    Py_buffer offs, data;
    Py_ssize_t n, offset;
    int wide;
    PyObject *no_headers, *headers;
    if (!PyArg_ParseTuple(args, "y*y*nnpOO", &offs, &data, &n, &offset, &wide, &no_headers, &headers))
        return NULL;
    PyObject *out = NULL, *payloads = NULL, *bodies = NULL, *dicts = NULL;
    arrow_maps m = {.held = 0};
    const unsigned char *ob = arrow_rows(&offs, wide, n, offset, "arrow_puts");
    const unsigned char *db = (const unsigned char *)data.buf;
    if (ob == NULL || (payloads = PyList_New(n)) == NULL)
        goto done;
    if (headers == Py_None) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t a, b;
            if (arrow_slice(ob, wide, i, data.len, &a, &b) < 0)
                goto done;
            PyObject *body = PyBytes_FromStringAndSize((const char *)db + a, b - a);
            if (body == NULL)
                goto done;
            PyList_SET_ITEM(payloads, i, body);
        }
        out = payloads;
        payloads = NULL;
        goto done;
    }
    if (arrow_maps_open(&m, headers, n) < 0)
        goto done;
    if ((bodies = PyList_New(n)) == NULL || (dicts = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t a, b, m0, m1;
        if (arrow_slice(ob, wide, i, data.len, &a, &b) < 0)
            goto done;
        PyObject *body = PyBytes_FromStringAndSize((const char *)db + a, b - a);
        if (body == NULL)
            goto done;
        PyList_SET_ITEM(bodies, i, body);
        if (arrow_map_row(&m, i, &m0, &m1) < 0)
            goto done;
        PyObject *d, *payload;
        if (m0 == m1) {
            d = no_headers;
            Py_INCREF(d);
            payload = PyBytes_FromStringAndSize(NULL, 4 + b - a);
            if (payload != NULL) {
                memset(PyBytes_AS_STRING(payload), 0, 4);
                memcpy(PyBytes_AS_STRING(payload) + 4, db + a, (size_t)(b - a));
            }
        } else {
            int bad = -1;
            d = arrow_row_dict(m.b[1].buf, m.b[2].buf, m.b[2].len, m.b[3].buf, m.b[4].buf, m.b[4].len, m0, m1, &bad);
            if (d == NULL) {
                if (bad >= 0)
                    out = Py_BuildValue("(ns)", i, bad == 0 ? "key" : "value");
                goto done;
            }
            payload = encode_event_dict(d, db + a, b - a);
        }
        PyList_SET_ITEM(dicts, i, d);
        if (payload == NULL)
            goto done;
        PyList_SET_ITEM(payloads, i, payload);
    }
    out = Py_BuildValue("(NNN)", payloads, bodies, dicts);
    payloads = bodies = dicts = NULL;
done:
    arrow_maps_release(&m);
    Py_XDECREF(payloads);
    Py_XDECREF(bodies);
    Py_XDECREF(dicts);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&data);
    return out;
}

static int column_offsets(const Py_buffer *ob, Py_ssize_t data_len, const char *who, Py_ssize_t *n);

/* ------------------------------------------------------------------------ */
/* Payload columns with headers (the Spark sink's rows with headers): no Python object per row.
   arrow.py holds the twin of arrow_payload_column, staged.py that of merge_headers.

   arrow_payload_column(offsets, data, n, offset, wide, headers) -> (data, offsets, max_len) or (index, reason)
       arrow_puts' payloads of a column with ``headers`` (the same 6-tuple) as one column: their
       bytes joined, n + 1 native int64 offsets from 0, the longest payload's length; (index,
       "key" | "value") for the first header that is not strict UTF-8, as arrow_puts.
   merge_headers(data, offsets, extra, plain) -> (data, offsets, max_len) or None
       each row of a column (n + 1 native int64 offsets into data) re-encoded as
       format.encode_event(body, {**headers, **extra}) where ``extra`` is the header block of the
       extra headers (format.encode_event(b"", extra)); ``plain``: the rows are bodies without
       headers. None when a row is not one this rule covers exactly (a payload that does not
       decode, a header that is not strict UTF-8, a key repeated in one row): the caller decodes
       such rows in Python. */

/* A growing bytes object: written in place, sized to its contents at the end (no copy when
   the first size given is enough). */
typedef struct {
    PyObject *obj;
    unsigned char *p;
    Py_ssize_t len, cap;
} gbuf;

static int
gbuf_init(gbuf *g, Py_ssize_t cap)
{
    g->len = 0;
    g->cap = cap > 8 ? cap : 8;
    g->obj = PyBytes_FromStringAndSize(NULL, g->cap);
    if (g->obj == NULL)
        return -1;
    g->p = (unsigned char *)PyBytes_AS_STRING(g->obj);
    return 0;
}

static int
gbuf_reserve(gbuf *g, Py_ssize_t more)
{
    if (more < 0 || g->len > PY_SSIZE_T_MAX - more) {
        PyErr_NoMemory();
        return -1;
    }
    if (g->len + more <= g->cap)
        return 0;
    Py_ssize_t cap = g->cap;
    while (cap < g->len + more) {
        if (cap > PY_SSIZE_T_MAX / 2) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    if (_PyBytes_Resize(&g->obj, cap) < 0)
        return -1; /* g->obj is NULL now */
    g->p = (unsigned char *)PyBytes_AS_STRING(g->obj);
    g->cap = cap;
    return 0;
}

/* The bytes written (a new reference; g is spent). */
static PyObject *
gbuf_finish(gbuf *g)
{
    if (g->len != g->cap && _PyBytes_Resize(&g->obj, g->len) < 0)
        return NULL;
    PyObject *out = g->obj;
    g->obj = NULL;
    return out;
}

typedef struct {
    const unsigned char *k, *v;
    Py_ssize_t kl, vl;
} hentry;

typedef struct {
    hentry *e;
    Py_ssize_t n, cap;
} hlist;

static int
hlist_push(hlist *h, const unsigned char *k, Py_ssize_t kl, const unsigned char *v, Py_ssize_t vl)
{
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 16;
        hentry *e = PyMem_Realloc(h->e, (size_t)cap * sizeof(hentry));
        if (e == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        h->e = e;
        h->cap = cap;
    }
    h->e[h->n].k = k;
    h->e[h->n].kl = kl;
    h->e[h->n].v = v;
    h->e[h->n].vl = vl;
    h->n++;
    return 0;
}

/* The index of key (k, kl) among the first n entries of h, or -1. */
static Py_ssize_t
hlist_find(const hlist *h, Py_ssize_t n, const unsigned char *k, Py_ssize_t kl)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (h->e[i].kl == kl && memcmp(h->e[i].k, k, (size_t)kl) == 0)
            return i;
    return -1;
}

static int
strict_utf8(const unsigned char *s, Py_ssize_t n)
{
    int sur = 0;
    return utf8_check(s, (size_t)n, &sur) == 0 && !sur;
}

/* Append format.encode_event(body, entries) to out and its end to offs; track the longest. */
static int
write_event(gbuf *out, gbuf *offs, const hlist *h, const unsigned char *body, Py_ssize_t blen, Py_ssize_t *longest)
{
    Py_ssize_t size = 4 + blen;
    for (Py_ssize_t i = 0; i < h->n; i++)
        size += 8 + h->e[i].kl + h->e[i].vl;
    if (h->n > 0xFFFFFFFF || gbuf_reserve(out, size) < 0 || gbuf_reserve(offs, 8) < 0)
        return -1;
    unsigned char *p = out->p + out->len;
    put_u32(p, (uint32_t)h->n);
    p += 4;
    for (Py_ssize_t i = 0; i < h->n; i++) {
        const hentry *e = &h->e[i];
        put_u32(p, (uint32_t)e->kl);
        put_u32(p + 4, (uint32_t)e->vl);
        memcpy(p + 8, e->k, (size_t)e->kl);
        memcpy(p + 8 + e->kl, e->v, (size_t)e->vl);
        p += 8 + e->kl + e->vl;
    }
    if (blen)
        memcpy(p, body, (size_t)blen);
    out->len += size;
    int64_t end = (int64_t)out->len;
    memcpy(offs->p + offs->len, &end, 8);
    offs->len += 8;
    if (size > *longest)
        *longest = size;
    return 0;
}

/* (data, offsets, longest) of the column in out/offs (both spent). */
static PyObject *
column_result(gbuf *out, gbuf *offs, Py_ssize_t longest)
{
    PyObject *d = gbuf_finish(out), *o = d != NULL ? gbuf_finish(offs) : NULL;
    if (o == NULL) {
        Py_XDECREF(d);
        return NULL;
    }
    return Py_BuildValue("(NNn)", d, o, longest);
}

/* out sized for ``data_bound`` bytes, offs for n + 1 offsets, the first 0. */
static int
column_start(gbuf *out, gbuf *offs, Py_ssize_t data_bound, Py_ssize_t n)
{
    if (gbuf_init(out, data_bound) < 0 || gbuf_init(offs, 8 * (n + 1)) < 0)
        return -1;
    memset(offs->p, 0, 8);
    offs->len = 8;
    return 0;
}

static PyObject *
sp_arrow_payload_column(PyObject *self, PyObject *args)
{
    Py_buffer offs, data;
    Py_ssize_t n, offset;
    int wide;
    PyObject *headers;
    if (!PyArg_ParseTuple(args, "y*y*nnpO", &offs, &data, &n, &offset, &wide, &headers))
        return NULL;
    PyObject *result = NULL;
    arrow_maps m = {.held = 0};
    gbuf out = {NULL, NULL, 0, 0}, co = {NULL, NULL, 0, 0};
    hlist h = {NULL, 0, 0};
    Py_ssize_t longest = 0;
    const unsigned char *ob = arrow_rows(&offs, wide, n, offset, "arrow_puts");
    if (ob == NULL || arrow_maps_open(&m, headers, n) < 0)
        goto done;
    const unsigned char *db = (const unsigned char *)data.buf;
    const unsigned char *kd = m.b[2].buf, *vd = m.b[4].buf;
    {
        /* enough for every payload: the rows' bodies, a count each, every entry of the map column */
        int32_t m_first, m_last;
        memcpy(&m_first, m.mo, 4);
        memcpy(&m_last, m.mo + 4 * n, 4);
        Py_ssize_t entries = m_last > m_first ? (Py_ssize_t)(m_last - m_first) : 0;
        if (column_start(&out, &co, data.len + 4 * n + 8 * entries + m.b[2].len + m.b[4].len, n) < 0)
            goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t a, b, x, y;
        if (arrow_slice(ob, wide, i, data.len, &a, &b) < 0 || arrow_map_row(&m, i, &x, &y) < 0)
            goto done;
        h.n = 0;
        for (Py_ssize_t j = x; j < y; j++) { /* as a dict: a repeated key keeps its first place, last value */
            Py_ssize_t ka, kb, va, vb;
            if (arrow_slice(m.b[1].buf, 0, j, m.b[2].len, &ka, &kb) < 0 ||
                arrow_slice(m.b[3].buf, 0, j, m.b[4].len, &va, &vb) < 0)
                goto done;
            if (!strict_utf8(kd + ka, kb - ka)) {
                result = Py_BuildValue("(ns)", i, "key");
                goto done;
            }
            if (!strict_utf8(vd + va, vb - va)) {
                result = Py_BuildValue("(ns)", i, "value");
                goto done;
            }
            Py_ssize_t at = hlist_find(&h, h.n, kd + ka, kb - ka);
            if (at >= 0) {
                h.e[at].v = vd + va;
                h.e[at].vl = vb - va;
            } else if (hlist_push(&h, kd + ka, kb - ka, vd + va, vb - va) < 0) {
                goto done;
            }
        }
        if (write_event(&out, &co, &h, db + a, b - a, &longest) < 0)
            goto done;
    }
    result = column_result(&out, &co, longest);
done:
    arrow_maps_release(&m);
    Py_XDECREF(out.obj);
    Py_XDECREF(co.obj);
    PyMem_Free(h.e);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&data);
    return result;
}

/* Parse a header block at p (len bytes available) into h (appended); the bytes it takes, or -1
   when it does not decode, or holds a header that is not strict UTF-8 or a repeated key. */
static Py_ssize_t
parse_headers(const unsigned char *p, Py_ssize_t len, hlist *h)
{
    if (len < 4)
        return -1;
    uint32_t count = get_u32(p);
    if (count > (uint64_t)(len - 4) / 8)
        return -1;
    Py_ssize_t pos = 4, first = h->n;
    for (uint32_t c = 0; c < count; c++) {
        if (len - pos < 8)
            return -1;
        Py_ssize_t kl = get_u32(p + pos), vl = get_u32(p + pos + 4);
        pos += 8;
        if (kl > len - pos || vl > len - pos - kl)
            return -1;
        const unsigned char *k = p + pos, *v = p + pos + kl;
        if (!strict_utf8(k, kl) || !strict_utf8(v, vl))
            return -1;
        for (Py_ssize_t i = first; i < h->n; i++)
            if (h->e[i].kl == kl && memcmp(h->e[i].k, k, (size_t)kl) == 0)
                return -1;
        if (hlist_push(h, k, kl, v, vl) < 0)
            return -2;
        pos += kl + vl;
    }
    return pos;
}

static PyObject *
sp_merge_headers(PyObject *self, PyObject *args)
{
    Py_buffer data, offs, extra;
    int plain;
    if (!PyArg_ParseTuple(args, "y*y*y*p", &data, &offs, &extra, &plain))
        return NULL;
    PyObject *result = NULL;
    gbuf out = {NULL, NULL, 0, 0}, co = {NULL, NULL, 0, 0};
    hlist ex = {NULL, 0, 0}, h = {NULL, 0, 0};
    char *used = NULL;
    Py_ssize_t n, longest = 0;
    if (column_offsets(&offs, data.len, "merge_headers", &n) < 0)
        goto done;
    Py_ssize_t got = parse_headers(extra.buf, extra.len, &ex);
    if (got == -2)
        goto done;
    if (got != extra.len) {
        PyErr_SetString(PyExc_ValueError, "merge_headers: extra is not one header block");
        goto done;
    }
    if ((used = PyMem_Malloc((size_t)ex.n + 1)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* enough for every row: its bytes, a count (plain rows), every extra entry (added, or replacing a value) */
    Py_ssize_t per_row = extra.len + 4, bound = data.len;
    if (n && per_row <= (PY_SSIZE_T_MAX / 2 - data.len) / n)
        bound += n * per_row;
    if (column_start(&out, &co, bound, n) < 0)
        goto done;
    const unsigned char *db = data.buf;
    const unsigned char *ob = offs.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a, b;
        memcpy(&a, ob + 8 * i, 8);
        memcpy(&b, ob + 8 * (i + 1), 8);
        const unsigned char *row = db + a;
        Py_ssize_t len = (Py_ssize_t)(b - a), hlen = 0;
        h.n = 0;
        if (!plain) {
            hlen = parse_headers(row, len, &h);
            if (hlen == -2)
                goto done;
            if (hlen < 0) {
                Py_INCREF(Py_None);
                result = Py_None;
                goto done;
            }
        }
        Py_ssize_t own = h.n;
        memset(used, 0, (size_t)ex.n + 1);
        for (Py_ssize_t j = 0; j < own; j++) {
            Py_ssize_t at = hlist_find(&ex, ex.n, h.e[j].k, h.e[j].kl);
            if (at >= 0) {
                h.e[j].v = ex.e[at].v;
                h.e[j].vl = ex.e[at].vl;
                used[at] = 1;
            }
        }
        for (Py_ssize_t j = 0; j < ex.n; j++)
            if (!used[j] && hlist_push(&h, ex.e[j].k, ex.e[j].kl, ex.e[j].v, ex.e[j].vl) < 0)
                goto done;
        if (write_event(&out, &co, &h, row + hlen, len - hlen, &longest) < 0)
            goto done;
    }
    result = column_result(&out, &co, longest);
done:
    Py_XDECREF(out.obj);
    Py_XDECREF(co.obj);
    PyMem_Free(ex.e);
    PyMem_Free(h.e);
    PyMem_Free(used);
    PyBuffer_Release(&data);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&extra);
    return result;
}

/* ------------------------------------------------------------------------ */
/* PUT columns: a transaction's puts as one data buffer and native int64 offsets (payload i is
   data[offsets[i]:offsets[i + 1]]), framed without a Python object per payload. format.py holds
   the twins of column_frames_size and encode_column; arrow.py the twin of put_column.

   put_column(offsets, data, n, offset, wide) -> (data, offsets, max_len)
       rows offset .. offset + n - 1 of an Arrow binary column (int32 or, ``wide``, int64 offsets)
       copied into a column of their own: a new bytes object holding the rows' bytes, their int64
       offsets from 0 (n + 1 of them, as bytes), and the longest row's length. The copy is what the
       transaction keeps: the caller's buffers may change after put_arrow returns.
   column_frames_size(offsets, extra) -> int
       the bytes the PUT frames of a column occupy when each stored payload is ``extra`` bytes
       longer than its row: format.frames_size of the column's payloads.
   encode_column(seed, kind, woid, txn_id, data, offsets, out_offsets, out_sizes, offset,
                 seal=None, tag_len=0, prefix=b"", out=None, at=0) -> (frames, end_offset)
       encode_puts of the column's payloads: the same bytes, offsets and sizes. Without ``seal``
       no Python object is made per payload, and a large column is framed without the GIL. With
       ``out`` (a writable buffer) the frames are written there from ``at`` instead, and their
       length is returned in place of the bytes (the writer reuses one buffer: no page faults). */

/* The n + 1 native int64 offsets of a column in ``ob``, checked: ascending from >= 0, the last
   within ``data_len``. Sets *n; -1 with a ValueError naming ``who`` otherwise. */
static int
column_offsets(const Py_buffer *ob, Py_ssize_t data_len, const char *who, Py_ssize_t *n)
{
    if (ob->len < 8 || ob->len % 8) {
        PyErr_Format(PyExc_ValueError, "%s: a column's offsets are n + 1 int64s", who);
        return -1;
    }
    Py_ssize_t k = ob->len / 8 - 1;
    const unsigned char *p = ob->buf;
    int64_t prev;
    memcpy(&prev, p, 8);
    if (prev < 0) {
        PyErr_Format(PyExc_ValueError, "%s: an offset lies outside the data buffer", who);
        return -1;
    }
    for (Py_ssize_t i = 1; i <= k; i++) {
        int64_t x;
        memcpy(&x, p + 8 * i, 8);
        if (x < prev) {
            PyErr_Format(PyExc_ValueError, "%s: an offset lies outside the data buffer", who);
            return -1;
        }
        prev = x;
    }
    if (prev > (int64_t)data_len) {
        PyErr_Format(PyExc_ValueError, "%s: an offset lies outside the data buffer", who);
        return -1;
    }
    *n = k;
    return 0;
}

static PyObject *
sp_put_column(PyObject *self, PyObject *args)
{
    Py_buffer offs, data;
    Py_ssize_t n, offset;
    int wide;
    if (!PyArg_ParseTuple(args, "y*y*nnp", &offs, &data, &n, &offset, &wide))
        return NULL;
    PyObject *out = NULL, *obytes = NULL, *dbytes = NULL;
    const unsigned char *ob = arrow_rows(&offs, wide, n, offset, "put_column");
    if (ob == NULL || (obytes = PyBytes_FromStringAndSize(NULL, (n + 1) * 8)) == NULL)
        goto done;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(obytes);
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (wide) {
            memcpy(&o[i], ob + 8 * i, 8);
        } else {
            int32_t x;
            memcpy(&x, ob + 4 * i, 4);
            o[i] = x;
        }
    }
    int64_t first = o[0], longest = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t a = o[i], b = o[i + 1];
        if (a < 0 || b < a || b > (int64_t)data.len) {
            PyErr_SetString(PyExc_ValueError, "put_column: an offset lies outside the data buffer");
            goto done;
        }
        if (b - a > longest)
            longest = b - a;
    }
    if (n == 0)
        first = 0;
    Py_ssize_t total = n ? (Py_ssize_t)(o[n] - first) : 0;
    dbytes = PyBytes_FromStringAndSize(n ? (const char *)data.buf + first : NULL, total);
    if (dbytes == NULL)
        goto done;
    for (Py_ssize_t i = 0; i <= n; i++)
        o[i] = n ? o[i] - first : 0;
    out = Py_BuildValue("(NNL)", dbytes, obytes, (long long)longest);
    dbytes = obytes = NULL;
done:
    Py_XDECREF(dbytes);
    Py_XDECREF(obytes);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&data);
    return out;
}

static PyObject *
sp_column_frames_size(PyObject *self, PyObject *args)
{
    Py_buffer ob;
    Py_ssize_t extra;
    if (!PyArg_ParseTuple(args, "y*n", &ob, &extra))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t n;
    if (column_offsets(&ob, (Py_ssize_t)1 << 62, "column_frames_size", &n) == 0) { /* the twin's bound: no overflow */
        const unsigned char *p = ob.buf;
        long long total = 0;
        int64_t a, b;
        memcpy(&a, p, 8);
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(&b, p + 8 * (i + 1), 8);
            long long k = (long long)(b - a) + extra;
            total += (k + HEADER_LEN + 7) & ~7LL;
            a = b;
        }
        out = PyLong_FromLongLong(total);
    }
    PyBuffer_Release(&ob);
    return out;
}

/* Frame payload ``i`` at ``p`` (its head already written): checksum, prefix + row copied, padding. */
static inline Py_ssize_t
frame_row(unsigned char *p, extend_fn ext, uint32_t seed, const unsigned char *prefix, Py_ssize_t prefix_len,
          const unsigned char *row, Py_ssize_t row_len)
{
    Py_ssize_t n = prefix_len + row_len;
    Py_ssize_t pad = -n & 7;
    memcpy(p + HEADER_LEN, prefix, (size_t)prefix_len);
    memcpy(p + HEADER_LEN + prefix_len, row, (size_t)row_len);
    uint32_t c = ext(seed, p, 24);
    c = ext(c, p + HEADER_LEN, (size_t)n);
    put_u32(p + 24, c);
    put_u32(p + 28, 0);
    memset(p + HEADER_LEN + n, 0, (size_t)pad);
    return HEADER_LEN + n + pad;
}

static PyObject *
sp_encode_column(PyObject *self, PyObject *args)
{
    unsigned long seed_l;
    int kind;
    unsigned long long woid, txn_id;
    Py_buffer data, ob;
    PyObject *offsets, *sizes;
    Py_ssize_t offset;
    PyObject *seal = Py_None;
    Py_ssize_t tag_len = 0;
    const char *prefix = "";
    Py_ssize_t prefix_len = 0;
    PyObject *into = Py_None;
    Py_ssize_t at = 0;
    if (!PyArg_ParseTuple(args, "kiKKy*y*OOn|Ony#On", &seed_l, &kind, &woid, &txn_id, &data, &ob, &offsets, &sizes,
                          &offset, &seal, &tag_len, &prefix, &prefix_len, &into, &at))
        return NULL;
    PyObject *out = NULL;
    Py_buffer outbuf;
    int have_out = 0;
    int64_t *cols = NULL;
    Py_ssize_t count = 0;
    if (!PyList_Check(offsets) && !PyObject_HasAttrString(offsets, "frombytes")) {
        PyErr_SetString(PyExc_TypeError, "offsets must be a list or an array('q')");
        goto done;
    }
    if (!PyList_Check(sizes) && !PyObject_HasAttrString(sizes, "frombytes")) {
        PyErr_SetString(PyExc_TypeError, "sizes must be a list or an array('q')");
        goto done;
    }
    if (seal == Py_None)
        tag_len = 0;
    else if (tag_len < 0) {
        PyErr_SetString(PyExc_ValueError, "tag_len must not be negative");
        goto done;
    }
    extend_fn ext = extend_for(kind);
    if (ext == NULL)
        goto done;
    if (column_offsets(&ob, data.len, "encode_column", &count) < 0)
        goto done;
    uint32_t seed = (uint32_t)seed_l;
    const unsigned char *o = ob.buf, *db = data.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t a, b;
        memcpy(&a, o + 8 * i, 8);
        memcpy(&b, o + 8 * (i + 1), 8);
        Py_ssize_t n = prefix_len + (Py_ssize_t)(b - a) + tag_len;
        if ((unsigned long long)n > 0xFFFFFFFFull) {
            PyErr_SetString(PyExc_OverflowError, "record payload does not fit a u32 length");
            goto done;
        }
        total += HEADER_LEN + n + (-n & 7);
    }
    if (count > 0 && (cols = PyMem_Malloc((size_t)count * 2 * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *p;
    if (into != Py_None) {
        /* frames written into the caller's buffer at ``at`` (the writer's reused scratch) */
        if (PyObject_GetBuffer(into, &outbuf, PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "encode_column: the output buffer is read-only");
            goto done;
        }
        have_out = 1;
        if (at < 0 || outbuf.len - at < total) {
            PyErr_SetString(PyExc_ValueError, "encode_column: the output buffer is too short");
            goto done;
        }
        out = PyLong_FromSsize_t(total);
        if (out == NULL)
            goto done;
        p = (unsigned char *)outbuf.buf + at;
    } else {
        out = PyBytes_FromStringAndSize(NULL, total);
        if (out == NULL)
            goto done;
        p = (unsigned char *)PyBytes_AS_STRING(out);
    }
    const unsigned char *pre = (const unsigned char *)prefix;
    if (seal == Py_None) {
        /* Everything here is this call's own: the buffers are held, the output not yet shared. */
        int release = total >= CRC_RELEASE_GIL;
        PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
        Py_ssize_t at = offset;
        for (Py_ssize_t i = 0; i < count; i++) {
            int64_t a, b;
            memcpy(&a, o + 8 * i, 8);
            memcpy(&b, o + 8 * (i + 1), 8);
            Py_ssize_t n = prefix_len + (Py_ssize_t)(b - a);
            p[0] = OP_PUT;
            p[1] = 0;
            put_u16(p + 2, 0);
            put_u32(p + 4, (uint32_t)n);
            put_u64(p + 8, (uint64_t)(woid + (unsigned long long)i));
            put_u64(p + 16, (uint64_t)txn_id);
            Py_ssize_t size = frame_row(p, ext, seed, pre, prefix_len, db + a, (Py_ssize_t)(b - a));
            cols[i] = at;
            cols[count + i] = size;
            at += size;
            p += size;
        }
        offset = at;
        if (release)
            PyEval_RestoreThread(ts);
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            int64_t a, b;
            memcpy(&a, o + 8 * i, 8);
            memcpy(&b, o + 8 * (i + 1), 8);
            Py_ssize_t row_len = (Py_ssize_t)(b - a);
            Py_ssize_t n = prefix_len + row_len + tag_len;
            p[0] = OP_PUT;
            p[1] = FLAG_SEALED;
            put_u16(p + 2, 0);
            put_u32(p + 4, (uint32_t)n);
            put_u64(p + 8, (uint64_t)(woid + (unsigned long long)i));
            put_u64(p + 16, (uint64_t)txn_id);
            /* seal(frame bytes [0, 24), offset, prefix + row) -> ciphertext, as encode_puts calls it */
            PyObject *head = PyBytes_FromStringAndSize((const char *)p, 24);
            PyObject *off_obj = head ? PyLong_FromSsize_t(offset) : NULL;
            PyObject *plain = off_obj ? PyBytes_FromStringAndSize(NULL, prefix_len + row_len) : NULL;
            PyObject *ct = NULL;
            if (plain != NULL) {
                memcpy(PyBytes_AS_STRING(plain), prefix, (size_t)prefix_len);
                memcpy(PyBytes_AS_STRING(plain) + prefix_len, db + a, (size_t)row_len);
                PyObject *argv[3] = {head, off_obj, plain};
                ct = PyObject_Vectorcall(seal, argv, 3, NULL);
            }
            Py_XDECREF(head);
            Py_XDECREF(off_obj);
            Py_XDECREF(plain);
            if (ct == NULL) {
                Py_CLEAR(out);
                goto done;
            }
            if (!PyBytes_Check(ct) || PyBytes_GET_SIZE(ct) != n) {
                PyErr_Format(PyExc_ValueError, "the sealer returned %zd bytes for a %zd-byte sealed payload",
                             PyBytes_Check(ct) ? PyBytes_GET_SIZE(ct) : (Py_ssize_t)-1, n);
                Py_DECREF(ct);
                Py_CLEAR(out);
                goto done;
            }
            Py_ssize_t size = frame_row(p, ext, seed, (const unsigned char *)"", 0, (const unsigned char *)PyBytes_AS_STRING(ct), n);
            Py_DECREF(ct);
            cols[i] = offset;
            cols[count + i] = size;
            offset += size;
            p += size;
        }
    }
    if (count > 0) {
        for (int k = 0; k < 2; k++) {
            PyObject *col = k == 0 ? offsets : sizes;
            const int64_t *v = cols + (k == 0 ? 0 : count);
            int bad = 0;
            if (PyList_Check(col)) {
                for (Py_ssize_t i = 0; i < count && !bad; i++)
                    bad = append_ssize(col, (Py_ssize_t)v[i]) < 0;
            } else {
                bad = extend_column(col, v, count) < 0;
            }
            if (bad) {
                Py_CLEAR(out);
                break;
            }
        }
    }
done:
    PyMem_Free(cols);
    if (have_out)
        PyBuffer_Release(&outbuf);
    PyBuffer_Release(&data);
    PyBuffer_Release(&ob);
    if (out == NULL)
        return NULL;
    return Py_BuildValue("(Nn)", out, offset);
}

/* frame_buffer(n) -> bytearray of n bytes, not zero-filled: the writer's reused frame buffer
   (encode_column's ``out``), whose pages are then touched once, by the frames. Its content is
   unspecified (the twin, bytearray(n), gives zeros). */
static PyObject *
sp_frame_buffer(PyObject *self, PyObject *args)
{
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "n", &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "frame_buffer: a negative size");
        return NULL;
    }
    return PyByteArray_FromStringAndSize(NULL, n);
}

static PyMethodDef sp_methods[] = {
    {"bind_crc32c", sp_bind_crc32c, METH_VARARGS, "bind_crc32c(path) -> bool: use libcrc32c's crc32c_extend."},
    {"unbind_crc32c", sp_unbind_crc32c, METH_NOARGS, "unbind_crc32c(): use the built-in CRC-32C again."},
    {"use_table", sp_use_table, METH_VARARGS, "use_table(flag): tests only; force the table CRC-32C."},
    {"crc32c_impl", sp_crc32c_impl, METH_NOARGS, "crc32c_impl() -> str: the CRC-32C in use."},
    {"crc", sp_crc, METH_VARARGS, "crc(kind, data, seed=0) -> int: the checksum of data under kind, extending seed."},
    {"encode_puts", sp_encode_puts, METH_VARARGS,
     "encode_puts(seed, kind, woid, txn_id, payloads, offsets, sizes, offset, seal=None, tag_len=0)"
     " -> (frames, end_offset)."},
    {"frame_record", sp_frame_record, METH_VARARGS,
     "frame_record(seed, kind, head, payload) -> bytes: one record frame after its packed 24-byte head."},
    {"decode_puts", sp_decode_puts, METH_VARARGS,
     "decode_puts(buf, offsets, sizes, seed, kind, max_payload, decode, frame_error, event_error)"
     " -> list: per record (body, headers), its payload bytes, or an error instance (format.decode_puts)."},
    {"take_runs", sp_take_runs, METH_O,
     "take_runs(entries) -> (ranges, file_runs) or None: a transaction's takes grouped (takes.take_runs)."},
    {"close_batch", sp_close_batch, METH_VARARGS,
     "close_batch(seed, kind, parts, start, first_woid, woid) -> bytes: the BATCH_END frame closing parts."},
    {"frame_commit1", sp_frame_commit1, METH_VARARGS,
     "frame_commit1(seed, kind, woid, txn_id, payload, prefix, start, first_position) -> bytes: one PUT, its"
     " COMMIT and the BATCH_END, framed (a one-event transaction's write)."},
    {"frames_size", sp_frames_size, METH_VARARGS,
     "frames_size(payloads, extra) -> int: bytes of the PUT frames of payloads, each stored extra bytes longer."},
    {"int64_range", sp_int64_range, METH_VARARGS,
     "int64_range(first, n) -> bytes: first .. first + n - 1 as native int64s (for array('q').frombytes)."},
    {"take_slots", sp_take_slots, METH_VARARGS,
     "take_slots(cls, bodies, headers, a, m, first) -> (events, nbytes): take a stretch of a cache run"
     " (takes.take_slots)."},
    {"trim_heap", sp_trim_heap, METH_NOARGS, "trim_heap() -> bool: glibc malloc_trim(0); False elsewhere."},
    {"scan_batches", sp_scan_batches, METH_VARARGS,
     "scan_batches(buf, pos, seed, kind, max_payload, batch_last_woid, base, file_id, record_type, records[, run_type, offsets, sizes]) -> (end_of_verified_prefix, last_woid)."},
    {"arrow_verify", sp_arrow_verify, METH_VARARGS,
     "arrow_verify(buf, offsets, sizes, seed, kind, keyed) -> (ok, spans, error): a segment's PUT records checked"
     " (filechannel.arrow)."},
    {"arrow_events", sp_arrow_events, METH_VARARGS,
     "arrow_events(parts) -> (error, buffers): event payloads decoded into Arrow buffers"
     " (filechannel.arrow)."},
    {"arrow_puts", sp_arrow_puts, METH_VARARGS,
     "arrow_puts(offsets, data, n, offset, wide, no_headers, headers) -> the PUT payloads of an Arrow column"
     " (filechannel.arrow)."},
    {"arrow_payload_column", sp_arrow_payload_column, METH_VARARGS,
     "arrow_payload_column(offsets, data, n, offset, wide, headers) -> (data, offsets, max_len) or (index, reason):"
     " arrow_puts' payloads as one column (filechannel.arrow)."},
    {"merge_headers", sp_merge_headers, METH_VARARGS,
     "merge_headers(data, offsets, extra, plain) -> (data, offsets, max_len) or None: a column's events with"
     " extra headers merged (filechannel.staged)."},
    {"put_column", sp_put_column, METH_VARARGS,
     "put_column(offsets, data, n, offset, wide) -> (data, offsets, max_len): an Arrow binary column's rows"
     " copied into a PUT column (format.PutColumn)."},
    {"frame_buffer", sp_frame_buffer, METH_VARARGS,
     "frame_buffer(n) -> bytearray: n bytes, not zero-filled (encode_column's reused output buffer)."},
    {"column_frames_size", sp_column_frames_size, METH_VARARGS,
     "column_frames_size(offsets, extra) -> int: frames_size of a PUT column's payloads."},
    {"encode_column", sp_encode_column, METH_VARARGS,
     "encode_column(seed, kind, woid, txn_id, data, offsets, out_offsets, out_sizes, offset, seal=None, tag_len=0,"
     " prefix=b'', out=None, at=0) -> (frames or their length, end_offset): encode_puts of a PUT column."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sp_module = {
    PyModuleDef_HEAD_INIT, "filechannel._speedups",
    "The optional C fast path: batch framing, verified-batch scanning, batch take decoding (see _speedups.c).", -1, sp_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    crc32c_init_table();
#ifdef FC_HAVE_SSE42_PATH
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&sp_module);
    if (m == NULL)
        return NULL;
    return m;
}
