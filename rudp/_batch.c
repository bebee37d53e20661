/* rudp._batch: many datagrams per system call (Linux recvmmsg / sendmmsg).

Theory of operation
-------------------
The asyncio layer (rudp/aio/endpoint.py) moves datagrams between one UDP socket
and the core. Through CPython's socket module that is one recvfrom or sendto per
datagram, each a system call plus the method call, the argument parsing and the
address conversion around it. A game server's tick sends one snapshot to every
client: 256 clients, 256 sendto calls. This module does the same work in batches:

  recv_many(fd, limit, cache) -> list of (data, address)
      One recvmmsg for up to ``limit`` (at most BATCH) datagrams. An empty list
      when nothing waits; OSError (BlockingIOError, InterruptedError, ...) as
      recvfrom raises it when the call fails before the first datagram.
  send_many(fd, family, datagrams, start, cache) -> (next, errno)
      sendmmsg of datagrams[start:] (a list of (data, address)), BATCH per call,
      until every one has left or one fails: ``next`` is the index of the first
      that has not left, ``errno`` 0 when all did, the error of datagram ``next``
      otherwise, and -1 when its address is not one this module converts (the
      caller sends that one with socket.sendto, which knows every form).

Both behave exactly as the per-datagram calls they replace: the same address
tuples (CPython's makesockaddr: IPv4 ``(host, port)``, IPv6 ``(host, port,
flowinfo, scope_id)``, the host from inet_ntop), the same 65,536-byte receive
limit, the same errors, left for the caller to handle as it handles sendto's.
sendmmsg stops at the first datagram that fails and reports those before it as
sent, so the caller resumes after handling that one error, as its sendto loop did.

``cache`` is a dict owned by the caller (one per socket): received addresses map
to the tuple built for them the first time, so a peer's datagrams all carry the
same tuple object (its hash is computed once, and the core's lookups by address
hit at once), and each address tuple sent to maps to its sockaddr. It is cleared
when it reaches CACHE_LIMIT entries (spoofed sources cannot grow it). A cached
sockaddr that is not of the socket family's length (a caller wrote it) is not used:
it is converted again and replaced.

The GIL is held throughout: the socket is non-blocking, and the receive buffer is
this module's own (allocated on first use, touched only as deep as datagrams go).
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define BATCH 64
#define RECV_SIZE 65536 /* what the per-datagram path passes to recvfrom */
#define CACHE_LIMIT 16384 /* entries; at most a few MB, whatever the sources */

static char *recv_buffers = NULL;

/* -- addresses --------------------------------------------------------------- */

static PyObject *
make_address(const struct sockaddr_storage *ss)
{
    char host[INET6_ADDRSTRLEN];
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        if (inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host)) == NULL)
            return PyErr_SetFromErrno(PyExc_OSError);
        return Py_BuildValue("(si)", host, (int)ntohs(a->sin_port));
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        if (inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host)) == NULL)
            return PyErr_SetFromErrno(PyExc_OSError);
        return Py_BuildValue("(siII)", host, (int)ntohs(a->sin6_port),
                             (unsigned int)ntohl(a->sin6_flowinfo),
                             (unsigned int)a->sin6_scope_id);
    }
    PyErr_SetString(PyExc_OSError, "rudp._batch: unexpected address family");
    return NULL;
}

/* The cache key of a received address: its family, port and address bytes. */
static PyObject *
address_key(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        unsigned long long key = ((unsigned long long)ntohl(a->sin_addr.s_addr) << 16) |
                                 ntohs(a->sin_port);
        return PyLong_FromUnsignedLongLong(key);
    }
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    char raw[2 + 16 + 4 + 4];
    memcpy(raw, &a->sin6_port, 2);
    memcpy(raw + 2, &a->sin6_addr, 16);
    memcpy(raw + 18, &a->sin6_flowinfo, 4);
    memcpy(raw + 22, &a->sin6_scope_id, 4);
    return PyBytes_FromStringAndSize(raw, sizeof(raw));
}

static PyObject *
cached_address(PyObject *cache, const struct sockaddr_storage *ss)
{
    PyObject *key = address_key(ss);
    if (key == NULL)
        return NULL;
    PyObject *found = PyDict_GetItemWithError(cache, key);
    if (found != NULL) {
        Py_DECREF(key);
        Py_INCREF(found);
        return found;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *address = make_address(ss);
    if (address == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    if (PyDict_GET_SIZE(cache) >= CACHE_LIMIT)
        PyDict_Clear(cache);
    int failed = PyDict_SetItem(cache, key, address);
    Py_DECREF(key);
    if (failed) {
        Py_DECREF(address);
        return NULL;
    }
    return address;
}

/* ``address`` as a sockaddr for a socket of ``family``: 1 done, 0 not a form this
   module converts (the caller falls back to socket.sendto), -1 a Python error. */
static int
parse_address(PyObject *address, int family, struct sockaddr_storage *ss, socklen_t *len)
{
    if (!PyTuple_CheckExact(address))
        return 0;
    Py_ssize_t size = PyTuple_GET_SIZE(address);
    PyObject *host = size >= 2 ? PyTuple_GET_ITEM(address, 0) : NULL;
    PyObject *port_obj = size >= 2 ? PyTuple_GET_ITEM(address, 1) : NULL;
    if (host == NULL || !PyUnicode_CheckExact(host) || !PyLong_CheckExact(port_obj))
        return 0;
    const char *text = PyUnicode_AsUTF8(host);
    if (text == NULL)
        return -1;
    long port = PyLong_AsLong(port_obj);
    if (port == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (port < 0 || port > 65535)
        return 0;
    memset(ss, 0, sizeof(*ss));
    if (family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)ss;
        if (size != 2 || inet_pton(AF_INET, text, &a->sin_addr) != 1)
            return 0;
        a->sin_family = AF_INET;
        a->sin_port = htons((unsigned short)port);
        *len = sizeof(*a);
        return 1;
    }
    if (family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        unsigned long flowinfo = 0, scope_id = 0;
        if (size > 4 || strchr(text, '%') != NULL || inet_pton(AF_INET6, text, &a->sin6_addr) != 1)
            return 0;
        if (size >= 3) {
            PyObject *f = PyTuple_GET_ITEM(address, 2);
            if (!PyLong_CheckExact(f))
                return 0;
            flowinfo = PyLong_AsUnsignedLong(f);
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            if (flowinfo > 0xfffff)
                return 0;
        }
        if (size == 4) {
            PyObject *s = PyTuple_GET_ITEM(address, 3);
            if (!PyLong_CheckExact(s))
                return 0;
            scope_id = PyLong_AsUnsignedLong(s);
            if (PyErr_Occurred() || scope_id > 0xffffffffUL) {
                PyErr_Clear();
                return 0;
            }
        }
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((unsigned short)port);
        a->sin6_flowinfo = htonl((uint32_t)flowinfo);
        a->sin6_scope_id = (uint32_t)scope_id;
        *len = sizeof(*a);
        return 1;
    }
    return 0;
}

/* Whether ``address`` is a plain tuple of a str and ints, the only form looked up in
   the cache: a key equal to a cached one but of another type (a float or bool port, a
   tuple subclass) must reach socket.sendto, which may treat it differently. */
static int
plain_address(PyObject *address)
{
    if (!PyTuple_CheckExact(address))
        return 0;
    Py_ssize_t size = PyTuple_GET_SIZE(address);
    if (size < 2 || size > 4 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(address, 0)))
        return 0;
    for (Py_ssize_t i = 1; i < size; i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(address, i)))
            return 0;
    return 1;
}

/* The sockaddr of ``address`` from the cache, converted and cached on a miss. The
   cache is a plain dict the caller can write to: a value that is not bytes of the
   length this module stores for ``family`` (one longer than ``*ss`` would overrun it)
   counts as a miss, and the converted sockaddr replaces it. */
static int
sockaddr_of(PyObject *cache, PyObject *address, int family, struct sockaddr_storage *ss,
            socklen_t *len)
{
    if (!plain_address(address))
        return 0;
    PyObject *found = PyDict_GetItemWithError(cache, address);
    Py_ssize_t expected = family == AF_INET    ? (Py_ssize_t)sizeof(struct sockaddr_in)
                          : family == AF_INET6 ? (Py_ssize_t)sizeof(struct sockaddr_in6)
                                               : -1;
    if (found != NULL && PyBytes_CheckExact(found) && PyBytes_GET_SIZE(found) == expected) {
        *len = (socklen_t)expected;
        memcpy(ss, PyBytes_AS_STRING(found), (size_t)expected);
        return 1;
    }
    if (found == NULL && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear(); /* an unhashable address: socket.sendto will say what is wrong */
        return 0;
    }
    int ok = parse_address(address, family, ss, len);
    if (ok != 1)
        return ok;
    PyObject *raw = PyBytes_FromStringAndSize((const char *)ss, *len);
    if (raw == NULL)
        return -1;
    if (PyDict_GET_SIZE(cache) >= CACHE_LIMIT)
        PyDict_Clear(cache);
    int failed = PyDict_SetItem(cache, address, raw);
    Py_DECREF(raw);
    return failed ? -1 : 1;
}

/* -- recv_many ------------------------------------------------------------------ */

static PyObject *
recv_many(PyObject *module, PyObject *args)
{
    int fd, limit;
    PyObject *cache;
    if (!PyArg_ParseTuple(args, "iiO!:recv_many", &fd, &limit, &PyDict_Type, &cache))
        return NULL;
    if (limit < 1 || limit > BATCH)
        limit = BATCH;
    if (recv_buffers == NULL) {
        recv_buffers = PyMem_RawMalloc((size_t)BATCH * RECV_SIZE);
        if (recv_buffers == NULL)
            return PyErr_NoMemory();
    }
    struct mmsghdr msgs[BATCH];
    struct iovec iovs[BATCH];
    struct sockaddr_storage addrs[BATCH];
    for (int i = 0; i < limit; i++) {
        iovs[i].iov_base = recv_buffers + (size_t)i * RECV_SIZE;
        iovs[i].iov_len = RECV_SIZE;
        memset(&msgs[i].msg_hdr, 0, sizeof(msgs[i].msg_hdr));
        msgs[i].msg_hdr.msg_name = &addrs[i];
        msgs[i].msg_hdr.msg_namelen = sizeof(addrs[i]);
        msgs[i].msg_hdr.msg_iov = &iovs[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    int got = recvmmsg(fd, msgs, (unsigned int)limit, MSG_DONTWAIT, NULL);
    if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return PyList_New(0);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *out = PyList_New(got);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < got; i++) {
        PyObject *data = PyBytes_FromStringAndSize(iovs[i].iov_base, msgs[i].msg_len);
        PyObject *address = data ? cached_address(cache, &addrs[i]) : NULL;
        PyObject *pair = address ? PyTuple_Pack(2, data, address) : NULL;
        Py_XDECREF(data);
        Py_XDECREF(address);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    return out;
}

/* -- send_many ------------------------------------------------------------------ */

static PyObject *send_items(int fd, int family, PyObject *items, Py_ssize_t start,
                            PyObject *cache);

static PyObject *
send_many(PyObject *module, PyObject *args)
{
    int fd, family;
    Py_ssize_t start;
    PyObject *datagrams, *cache;
    if (!PyArg_ParseTuple(args, "iiO!nO!:send_many", &fd, &family, &PyList_Type, &datagrams,
                          &start, &PyDict_Type, &cache))
        return NULL;
    /* A snapshot: Python code can run inside the loop (an address's __eq__ in the
       cache lookup, a buffer export), and must not be able to shrink the list under it. */
    PyObject *items = PyList_AsTuple(datagrams);
    if (items == NULL)
        return NULL;
    PyObject *result = send_items(fd, family, items, start, cache);
    Py_DECREF(items);
    return result;
}

static PyObject *
send_items(int fd, int family, PyObject *items, Py_ssize_t start, PyObject *cache)
{
    Py_ssize_t total = PyTuple_GET_SIZE(items);
    if (start < 0)
        start = 0;
    struct mmsghdr msgs[BATCH];
    struct iovec iovs[BATCH];
    struct sockaddr_storage addrs[BATCH];
    Py_buffer views[BATCH];
    while (start < total) {
        int count = 0;
        int stop = 0; /* 0, or -1: datagram start + count needs socket.sendto */
        while (count < BATCH && start + count < total) {
            PyObject *pair = PyTuple_GET_ITEM(items, start + count);
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
                stop = -1;
                break;
            }
            socklen_t len = 0;
            int ok = sockaddr_of(cache, PyTuple_GET_ITEM(pair, 1), family, &addrs[count], &len);
            if (ok < 0)
                goto error;
            if (ok == 0) {
                stop = -1;
                break;
            }
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 0), &views[count], PyBUF_SIMPLE) < 0) {
                PyErr_Clear(); /* not bytes-like: socket.sendto raises what it raises */
                stop = -1;
                break;
            }
            iovs[count].iov_base = views[count].buf;
            iovs[count].iov_len = (size_t)views[count].len;
            memset(&msgs[count].msg_hdr, 0, sizeof(msgs[count].msg_hdr));
            msgs[count].msg_hdr.msg_name = &addrs[count];
            msgs[count].msg_hdr.msg_namelen = len;
            msgs[count].msg_hdr.msg_iov = &iovs[count];
            msgs[count].msg_hdr.msg_iovlen = 1;
            count++;
            continue;
        error:
            for (int i = 0; i < count; i++)
                PyBuffer_Release(&views[i]);
            return NULL;
        }
        int sent = 0, err = 0;
        if (count > 0) {
            sent = sendmmsg(fd, msgs, (unsigned int)count, MSG_DONTWAIT);
            if (sent < 0) {
                err = errno;
                sent = 0;
            }
        }
        for (int i = 0; i < count; i++)
            PyBuffer_Release(&views[i]);
        start += sent;
        if (err != 0)
            return Py_BuildValue("(ni)", start, err);
        if (sent == 0 && count > 0) /* nothing left and no error: wait for writability */
            return Py_BuildValue("(ni)", start, EAGAIN);
        if (sent < count) /* stopped early without an error: the next call says why */
            continue;
        if (stop != 0)
            return Py_BuildValue("(ni)", start, stop);
    }
    return Py_BuildValue("(ni)", start, 0);
}

static PyMethodDef methods[] = {
    {"recv_many", recv_many, METH_VARARGS,
     "recv_many(fd, limit, cache) -> [(data, address), ...]: one recvmmsg"},
    {"send_many", send_many, METH_VARARGS,
     "send_many(fd, family, datagrams, start, cache) -> (next, errno): sendmmsg until done"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "rudp._batch",
    "Many datagrams per system call (recvmmsg, sendmmsg); see rudp/_batch.c.", -1, methods,
};

PyMODINIT_FUNC
PyInit__batch(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "BATCH", BATCH) < 0 ||
        PyModule_AddIntConstant(module, "CACHE_LIMIT", CACHE_LIMIT) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
