/*
 * Posting a whole segment list with one foreign call (the ucx backend's compiled path).
 *
 * Why this file exists: posting from Python costs ~1.5-1.9 us per segment (a ctypes call
 * plus the loop), which on 4096 x 16 KiB scattered blocks is as much as UCX's own work.
 * Here the loop over segments runs in C, without the GIL (ctypes releases it around the
 * call), and adjacent segments are merged into one operation. kvt_post_share does all of one
 * lane's share of a transfer in one call: post, flush, drive the worker, check the flush.
 *
 * No UCX header is needed: the backend hands over the addresses of ucp_put_nbx /
 * ucp_get_nbx and ucp_request_free from the libucp it already loaded, so this library
 * always calls the same UCX as the rest of the backend. It is built as a plain shared
 * library (setuptools Extension, optional: without a compiler the backend posts from
 * Python, kvtransport_ucx/native.py) and loaded with ctypes; it never includes Python.h.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ucs_status_ptr_t ucp_put_nbx(ucp_ep_h, const void *buffer, size_t count,
 *                              uint64_t remote_addr, ucp_rkey_h, const ucp_request_param_t *);
 * ucp_get_nbx has the same shape (buffer is the destination). */
typedef void *(*kvt_rma_fn)(void *ep, void *buffer, size_t count, uint64_t remote_addr,
                            void *rkey, const void *param);
typedef void (*kvt_free_fn)(void *request);

/* UCS_PTR_IS_ERR: the status pointer lies in [UCS_ERR_LAST, -1] (UCS_ERR_LAST = -100). */
#define KVT_UCS_ERR_LAST (-100)
#define KVT_PTR_IS_ERR(p) ((uintptr_t)(p) >= (uintptr_t)(intptr_t)KVT_UCS_ERR_LAST)

/*
 * Post n segments (local address, remote address, length) on one endpoint.
 *
 * rkeys / params: arrays of n pointers, or one pointer used for every segment when the
 * matching *_step is 0 (the common one-region case). A segment that starts where the
 * previous run ends, on both sides, with the same rkey and param, extends that run.
 *
 * Returns the number of UCP operations posted (>= 0). On a refused post it stops there,
 * stores the UCS status (< 0) in *status and the index of the first segment of the
 * refused run in *failed_at; otherwise *status is 0. Requests UCX returns are released at
 * once (UCX keeps them until they complete; completion is observed through a flush).
 */
int64_t kvt_post_segments(kvt_rma_fn rma, kvt_free_fn release, void *ep,
                          const uint64_t *laddr, const uint64_t *raddr, const uint64_t *len,
                          void *const *rkeys, int64_t rkey_step,
                          void *const *params, int64_t param_step,
                          int64_t n, int64_t *status, int64_t *failed_at)
{
    int64_t ops = 0, i = 0;
    *status = 0;
    *failed_at = -1;
    while (i < n) {
        int64_t first = i;
        uint64_t la = laddr[i], ra = raddr[i], ln = len[i];
        void *rk = rkeys[i * rkey_step];
        const void *pp = params[i * param_step];
        for (++i; i < n; ++i) {
            if (laddr[i] != la + ln || raddr[i] != ra + ln || rkeys[i * rkey_step] != rk ||
                params[i * param_step] != pp)
                break;
            ln += len[i];
        }
        if (ln == 0)
            continue;
        void *r = rma(ep, (void *)(uintptr_t)la, (size_t)ln, ra, rk, pp);
        if (r != NULL) {
            if (KVT_PTR_IS_ERR(r)) {
                *status = (int64_t)(intptr_t)r;
                *failed_at = first;
                return ops;
            }
            release(r);
        }
        ++ops;
    }
    return ops;
}

/* unsigned ucp_worker_progress(ucp_worker_h); ucs_status_t ucp_request_check_status(void *);
 * ucs_status_ptr_t ucp_ep_flush_nbx(ucp_ep_h, const ucp_request_param_t *). */
typedef unsigned (*kvt_progress_fn)(void *worker);
typedef int (*kvt_check_fn)(void *request);
typedef void *(*kvt_flush_fn)(void *ep, const void *param);

static int64_t kvt_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/*
 * Drive `worker` while `request` is in progress (its status is `inprogress`, UCS_INPROGRESS)
 * and UCX reports work done, for at most budget_ns.
 *
 * Why in C: with cma each ucp_worker_progress call copies one fragment (512 KiB here), so a
 * 16 MiB transfer takes 32 calls; the same loop in Python cost ~3 us per call (two ctypes
 * calls and a clock read, the GIL dropped and taken back each time), ~100 us per 16 MiB, a
 * tenth of the copy. The caller holds the worker's lock (the worker is SERIALIZED).
 */
static void kvt_progress_while(kvt_progress_fn progress, kvt_check_fn check, void *worker,
                               void *request, int inprogress, int64_t budget_ns)
{
    int64_t until = kvt_now_ns() + budget_ns;
    while (check(request) == inprogress && progress(worker)) {
        if (kvt_now_ns() >= until)
            break;
    }
}

/* The libucp functions and constants one share needs (filled once per agent by native.py). */
struct kvt_ucp {
    kvt_rma_fn get, put;
    kvt_free_fn release;
    kvt_flush_fn flush;
    kvt_progress_fn progress;
    kvt_check_fn check;
    const void *flush_param; /* ucp_request_param_t of the flush (no callback: polled) */
    int64_t inprogress;      /* UCS_INPROGRESS */
};

/* One lane's share of a transfer: n segments, as for kvt_post_segments. */
struct kvt_share {
    const uint64_t *laddr, *raddr, *len;
    void *const *rkeys;
    int64_t rkey_step;
    void *const *params;
    int64_t param_step;
    int64_t n;
    void *rkey;  /* storage for the one key / one param of the common one-region case */
    void *param;
};

/* What became of a share (see kvt_post_share). */
struct kvt_outcome {
    int64_t rma_status;   /* 0, or the UCS status of the first refused post */
    int64_t failed_at;    /* index of the first segment of the refused run, or -1 */
    void *flush;          /* the flush request if it is still in progress, else NULL */
    int64_t flush_status; /* the flush's status: UCS_OK or an error once it ended (its request
                             is then already released), `inprogress` while `flush` is set */
};

/*
 * Post a share, flush its endpoint, and drive the worker while the flush is in progress,
 * for at most budget_ns (0: do not drive), in one foreign call. The caller holds the lane's
 * lock.
 *
 * Why one call: these were five ctypes calls per transfer (post, flush, progress loop, then
 * status check and release of the flush from the completion path), each with its argument
 * conversion, ~25 us of a 1 MiB transfer's ~90 us. The flush is posted even after a refused
 * RMA post, so what was posted before it is waited for; a flush that ended here is released
 * here, and the caller only records its status.
 */
void kvt_post_share(const struct kvt_ucp *u, int write, void *worker, void *ep,
                    const struct kvt_share *s, int64_t budget_ns, struct kvt_outcome *out)
{
    kvt_post_segments(write ? u->put : u->get, u->release, ep, s->laddr, s->raddr, s->len,
                      s->rkeys, s->rkey_step, s->params, s->param_step, s->n,
                      &out->rma_status, &out->failed_at);
    void *r = u->flush(ep, u->flush_param);
    if (r == NULL) {
        out->flush = NULL;
        out->flush_status = 0;
        return;
    }
    if (KVT_PTR_IS_ERR(r)) {
        out->flush = NULL;
        out->flush_status = (int64_t)(intptr_t)r;
        return;
    }
    if (budget_ns > 0)
        kvt_progress_while(u->progress, u->check, worker, r, (int)u->inprogress, budget_ns);
    int st = u->check(r);
    if (st == (int)u->inprogress) {
        out->flush = r;
        out->flush_status = u->inprogress;
    } else {
        u->release(r);
        out->flush = NULL;
        out->flush_status = st;
    }
}

/*
 * Single-thread memcpy of n (dst, src, length) segments: the baseline that bench/ compares
 * scattered transfers with (a numpy gather/scatter pays for a temporary array and is not
 * what "memcpy of the same bytes" means). Returns the bytes copied.
 */
uint64_t kvt_memcpy_segments(const uint64_t *dst, const uint64_t *src, const uint64_t *len,
                             int64_t n)
{
    uint64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        memcpy((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)len[i]);
        total += len[i];
    }
    return total;
}
