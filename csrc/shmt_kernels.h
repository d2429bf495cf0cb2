/*
 * shmt_kernels.h -- C kernels of shmtransport: XXH3-128 hashing (one-shot, streaming, fused
 * copy+hash, chunked "tree" mode), packed is_embed bit-mask kernels, and the object-table
 * atomics (per-object lifetime in shared memory).
 *
 * Rules: every kernel validates the sizes it is given and never reads or
 * writes outside the buffers it is handed; no allocation, no threads, no syscalls in kernels.
 * Threads, buffer allocation and the XXH3 streaming state belong to the Python wrapper
 * (src/shmtransport/_native.py). The pure-Python module src/shmtransport/_purepy.py is the
 * specification: every kernel here must give bit-identical results.
 *
 * Return convention: SHMT_OK (0) on success, a negative SHMT_E* code on a rejected argument.
 * Counting kernels return the count (>= 0) or a negative error code.
 *
 * Tree mode (shmt_tree_leaves, shmt_copy_tree_leaves; the root is assembled by the wrapper):
 *   if nbytes <= SHMT_TREE_CHUNK_NBYTES the digest is plain XXH3-128 of the bytes; otherwise
 *   root = XXH3-128( "shmt-tree-v1\0" || u64le(SHMT_TREE_CHUNK_NBYTES) || u64le(nbytes)
 *                    || leaf_0 || leaf_1 || ... )
 *   where leaf_i = canonical (big-endian) XXH3-128 of chunk i = bytes [i*C, min((i+1)*C, nbytes)).
 *
 * Bit masks: packed bits, MSB-first within each byte (numpy.packbits default bitorder="big").
 * Bit i lives in byte i/8 at bit position 7 - i%8. Padding bits of the last byte are ignored on
 * input and written as zero on output. A packed buffer must hold at least ceil(nbits/8) bytes;
 * bytes beyond that are ignored.
 */
#ifndef SHMT_KERNELS_H
#define SHMT_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifndef SHMT_HAVE_XXH3
#define SHMT_HAVE_XXH3 1
#endif

#define SHMT_OK 0
#define SHMT_EINVAL (-1)  /* a size or range argument is inconsistent */
#define SHMT_ENOHASH (-2) /* built without XXH3: hashing kernels are unavailable */

/* Tree-mode chunk size: 1 MiB. Part of the digest definition: changing it changes digests. */
#define SHMT_TREE_CHUNK_NBYTES 1048576
/* Sub-block size of the fused copy+hash: hashed (pulling it into L1/L2), then copied from cache. */
#ifndef SHMT_FUSED_BLOCK_NBYTES
#define SHMT_FUSED_BLOCK_NBYTES 65536
#endif
/* Copies at least this large use non-temporal stores (the destination is not read back soon). */
#define SHMT_NT_MIN_NBYTES 262144

/* Opaque XXH3 streaming state; created and freed by the caller (XXH3_createState/XXH3_freeState). */
struct XXH3_state_s;

/* 1 when the hashing kernels are built in, else 0 (they then return SHMT_ENOHASH). */
int32_t shmt_have_xxh3(void);

/* out[16] = canonical XXH3-128 (seed 0) of buf[0..nbytes). */
int32_t shmt_xxh3_128(const uint8_t *buf, uint64_t nbytes, uint8_t *out, uint64_t out_nbytes);

/* Streaming XXH3-128 on a caller-owned state. */
int32_t shmt_xxh3_stream_reset(struct XXH3_state_s *state);
int32_t shmt_xxh3_stream_update(struct XXH3_state_s *state, const uint8_t *buf, uint64_t nbytes);
/* Fused: copies src to dst and feeds the src bytes into the state, sub-block by sub-block. */
int32_t shmt_xxh3_stream_copy_update(struct XXH3_state_s *state, uint8_t *dst, uint64_t dst_nbytes,
                                     const uint8_t *src, uint64_t src_nbytes);
int32_t shmt_xxh3_stream_digest(struct XXH3_state_s *state, uint8_t *out, uint64_t out_nbytes);

/* Leaves of tree mode: writes the digests of chunks [first, last) of buf (chunk size
 * SHMT_TREE_CHUNK_NBYTES) to out[16*(i-first)]; out_nbytes must be >= 16*(last-first). */
int32_t shmt_tree_leaves(const uint8_t *buf, uint64_t nbytes, uint64_t first, uint64_t last,
                         uint8_t *out, uint64_t out_nbytes);
/* Fused copy + tree leaves over the whole buffer: copies src to dst and writes the digest of every
 * chunk to out (16 bytes each; out_nbytes >= 16*ceil(nbytes/chunk)). `state` is scratch. */
int32_t shmt_copy_tree_leaves(struct XXH3_state_s *state, uint8_t *dst, uint64_t dst_nbytes,
                              const uint8_t *src, uint64_t src_nbytes, uint8_t *out, uint64_t out_nbytes);

/* Fastest copy we have: memcpy for small sizes, non-temporal stores for large ones. */
int32_t shmt_copy(uint8_t *dst, uint64_t dst_nbytes, const uint8_t *src, uint64_t src_nbytes);

/* Bit masks. `bools` holds one byte per bit (nonzero = set). */
int32_t shmt_mask_pack(const uint8_t *bools, uint64_t nbits, uint8_t *out, uint64_t out_nbytes);
int32_t shmt_mask_unpack(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                         uint8_t *out, uint64_t out_nbytes);
int64_t shmt_mask_popcount(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits);
/* Number of maximal runs of set bits. */
int64_t shmt_mask_count_runs(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits);
/* Positions of set bits; out_len must equal the popcount. */
int32_t shmt_mask_indices(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                          int64_t *out, uint64_t out_len);
/* (start, length) pairs of runs, flattened; out_len must equal 2 * count_runs. */
int32_t shmt_mask_runs(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                       int64_t *out, uint64_t out_len);
/* Inclusive cumulative sum; out_len must equal nbits. */
int32_t shmt_mask_cumsum(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                         int64_t *out, uint64_t out_len);
/* out[0] = #set in [0, start), out[1] = #set in [0, end); requires start <= end <= nbits. */
int32_t shmt_mask_window(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                         uint64_t start, uint64_t end, int64_t *out, uint64_t out_len);

/*
 * Object table: the lifetime of every arena object lives in shared memory, so loan, commit,
 * acquire and release touch only that (docs/objects.md has the invariants and the crash-window
 * analysis). Two segments of `nslots` 64-byte records each, indexed alike:
 *   - the slots (`table`, shmt_slot): what each object is. Written by the producers and the
 *     daemon only; consumers map them read-only, so a consumer can never change what anyone reads.
 *   - the holds (`holds`, shmt_hold): each slot's `holders` word on a cache line of its own, the
 *     one word every party changes, and only with atomic read-modify-writes:
 *   bits 0..61  one per session of the tenant (the daemon hands each live session one bit);
 *   bit 62      held by the daemon on behalf of clients without a bit (RPC path, remote tier);
 *   bit 63      the hand-off hold: set at commit, dropped by the first acquire (or when the
 *               hand-off window passes, by the daemon), so a committed object outlives its
 *               producer until a consumer takes it.
 * holders == 0 is terminal for a generation: nobody may honestly add a bit to it, so the owner of
 * the slot (or the daemon, for a dead owner) can reuse the slot and its bytes. Whoever takes the
 * bytes back first retires the slot (shmt_slot_retire: state FREE, in the slots, which consumers
 * cannot write), so a bit a client ORs into a dead word afterwards never makes a stale handle
 * match again.
 * Status codes of the slot kernels are >= 0: SHMT_SLOT_OK or one of the refusals below.
 */
#define SHMT_SLOT_NBYTES 64
#define SHMT_SESSION_BITS 62
#define SHMT_HOLDER_PROXY 62
#define SHMT_HOLDER_HANDOFF 63
#define SHMT_SLOT_FREE 0 /* no object: never used, or its object died and its bytes went back */
#define SHMT_SLOT_LOANED 1
#define SHMT_SLOT_COMMITTED 2
#define SHMT_SLOT_HELD 3 /* committed with a hold: the first acquire keeps the hand-off bit */

#define SHMT_SLOT_OK 0
#define SHMT_SLOT_STALE 1         /* freed, reused, or never this generation */
#define SHMT_SLOT_NOT_COMMITTED 2 /* still a loan */
#define SHMT_SLOT_MISMATCH 3      /* offset or size differ from the slot's */
#define SHMT_SLOT_ALREADY 4       /* this holder already holds it / it is not free */
#define SHMT_SLOT_NOT_HELD 5      /* released by a holder that does not hold it */
#define SHMT_SLOT_UNKNOWN 6       /* a generation this slot never had: a forged or corrupt handle */

typedef struct {
    uint64_t holders; /* atomic; see above */
    uint64_t unused[7];
} shmt_hold;

typedef struct {
    uint64_t generation;  /* of the object now in the slot; grows by one per reuse, never reset */
    uint64_t offset;      /* arena byte offset */
    uint64_t nbytes;
    uint64_t state;       /* SHMT_SLOT_FREE / _LOANED / _COMMITTED / _HELD */
    uint64_t deadline_ns; /* CLOCK_MONOTONIC end of the hand-off window (or of the hold) */
    uint64_t owner;       /* session bit of the producer that loaned it */
    uint64_t recall;      /* in a grant's first slot: the grant's id once the daemon wants its room back
                           * (the daemon writes it, the producer only reads it: it gives that grant
                           * back, through the daemon, once it is empty) */
    uint64_t daemon_pin;  /* 1 while the daemon holds the object for clients without a bit: its bytes
                           * are not reused, whatever a consumer writes into the holds (only the
                           * daemon writes it; consumers cannot write the slots) */
} shmt_slot;

/* Put a new object in a free slot (holders == 0): generation = old + 1, held by `bit` (its owner:
 * a session's bit, or the proxy bit for an object the daemon places for a client). */
int32_t shmt_slot_publish(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t offset,
                          uint64_t nbytes, uint32_t bit, uint64_t *generation);
/* Seal a loan held by `bit`: state = COMMITTED (HELD when `hold`), hand-off bit set. */
int32_t shmt_slot_commit(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t generation,
                         uint32_t bit, uint64_t deadline_ns, int32_t hold);
/* Add `bit` to a live committed object (COMMITTED or HELD; a retired one is STALE) of this
 * generation, offset and size; then drop the hand-off bit unless the object is HELD.
 * SHMT_SLOT_ALREADY when `bit` held that very object already (another lease of the same client);
 * any other refusal leaves the holders as they were. */
int32_t shmt_slot_acquire(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t generation,
                          uint64_t offset, uint64_t nbytes, uint32_t bit);
/* Drop `bit` (and the hand-off bit too when `cancel_handoff`); *remaining = holders after. */
int32_t shmt_slot_release(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t generation,
                          uint32_t bit, int32_t cancel_handoff, uint64_t *remaining);
/* The object in `index` died (holders == 0): mark the slot FREE before its bytes are reused.
 * SHMT_SLOT_ALREADY when anyone holds it, also when a bit appeared while it was being retired (a
 * client wrote it) or the daemon pins it: its bytes stay where they are until the word is 0 and
 * the pin gone; the slot stays FREE, so no handle acquires it meanwhile. Idempotent. */
int32_t shmt_slot_retire(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index);
/* Daemon: set (1) or clear (0) the slot's daemon_pin, before it acquires the object with the proxy
 * bit and after it released it (shmt_slot_retire's store-then-load pairs with it). */
int32_t shmt_slot_pin(uint8_t *table, uint64_t nslots, uint64_t index, uint64_t pinned);
/* Daemon: drop the hand-off bit of an object whose window ended before now_ns; *freed = 1 when
 * that left nobody holding it. */
int32_t shmt_slot_expire(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t now_ns,
                         int32_t *freed);
/* Daemon, for a session that ended: drop `bit` from slots [first, last); out[0] = slots it held,
 * out[1] = objects that left alive with nobody, out[2] = their bytes. */
int32_t shmt_slots_clear_bit(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t first, uint64_t last,
                             uint32_t bit, uint64_t *out, uint64_t out_len);

/* ---------------------------------------------------------------------------------------------
 * A producer's grant, placed in by one native call: its free bytes (best fit, the very policy of
 * shmtransport.allocator.Allocator, which tests/test_grant_space.py checks this against) and its
 * free slots (reused first in, first out), in one block of shmt_grant_space_nbytes(nslots) bytes
 * the producer allocates. Process-local: no other process ever sees it. Not thread-safe (the
 * producer's lock serializes it).
 * ------------------------------------------------------------------------------------------- */
#define SHMT_GRANT_NO_ROOM (-30)  /* no free slot, or no free extent that fits: nothing taken */
#define SHMT_GRANT_NOT_LIVE (-31) /* reclaim of a slot with no live object of this grant */

typedef struct {
    uint64_t base;           /* the grant's arena offset */
    uint64_t nbytes;         /* its size, a multiple of 4096 */
    uint64_t page_align_min; /* objects of this size or more start on a page */
    uint64_t used;           /* bytes reserved by live objects, alignment padding included */
    uint64_t largest;        /* the largest free extent */
    uint32_t first_slot;     /* table index of the grant's first slot */
    uint32_t nslots;
    uint32_t free_slots;     /* slots free */
    uint32_t slot_head;      /* the ring's oldest free slot */
    uint32_t nfree;          /* free extents */
    uint32_t cap;            /* room for free extents (nslots + 2: a live object splits at most one) */
} shmt_grant_space;

uint64_t shmt_grant_space_nbytes(uint32_t nslots);
int32_t shmt_grant_space_init(shmt_grant_space *g, uint64_t base, uint64_t nbytes, uint32_t first_slot,
                              uint32_t nslots, uint64_t page_align_min);
/* Place one object of `nbytes` (>= 1): best-fit bytes and the oldest free slot, published there
 * with `bit` (shmt_slot_publish). out[0] = arena offset, out[1] = generation, out[2] = table index
 * (set too when the publish refuses). SHMT_GRANT_NO_ROOM, or the publish's refusal: nothing is
 * taken either way. */
int32_t shmt_grant_place(shmt_grant_space *g, uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t nbytes,
                         uint32_t bit, uint64_t *out);
/* The object in table index `index` died: the slot is retired (shmt_slot_retire), then its bytes
 * and the slot go back to the grant. SHMT_SLOT_ALREADY (nothing goes back) while anyone holds it. */
int32_t shmt_grant_reclaim(shmt_grant_space *g, uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index);
/* shmt_slot_release of the grant's object in `index`, then shmt_grant_reclaim when that left
 * nobody holding it (*remaining == 0). *remaining = SHMT_NOT_RECLAIMED when nobody holds it but
 * its slot could not be retired (a bit written meanwhile, the daemon's pin): it stays the
 * producer's to reclaim later. */
#define SHMT_NOT_RECLAIMED UINT64_MAX
int32_t shmt_grant_release(shmt_grant_space *g, uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index,
                           uint64_t generation, uint32_t bit, int32_t cancel_handoff, uint64_t *remaining);

/* ---------------------------------------------------------------------------------------------
 * The handle on the wire: shmtransport.v1.TensorHandle (proto/shmtransport/v1/daemon.proto) in
 * protobuf's encoding, read and written without building protobuf objects (a handoff's hot path).
 *
 * shmt_wire_parse reads exactly what protobuf writes: known fields in field-number order, each
 * once with its declared wire type, no zero or empty field but shm, shortest varints, shape
 * packed; and of that only strings of ASCII and at most 32 dims. Anything else, valid or not, is
 * SHMT_WIRE_OTHER: the caller then parses with protobuf, which decides. So whatever this parser
 * accepts, protobuf reads the same values from and writes back byte for byte
 * (tests/test_wire_native.py checks it on random messages and random bytes).
 * ------------------------------------------------------------------------------------------- */
#define SHMT_WIRE_OTHER (-20) /* outside the subset: parse with protobuf */
#define SHMT_WIRE_MAX_DIMS 32

typedef struct {
    uint64_t offset;
    uint64_t nbytes;
    uint64_t generation;
    uint64_t slot; /* 1 + the object-table index; 0: not in a table */
    /* strings and bytes, as [at, at + len) of the buffer parsed */
    uint64_t name_at, name_len;
    uint64_t owner_at, owner_len;
    uint64_t instance_at, instance_len;
    uint64_t dtype_at, dtype_len;
    uint64_t digest_at, digest_len;
    uint64_t token_at, token_len;
    uint64_t ndim;
    uint64_t shape[32]; /* SHMT_WIRE_MAX_DIMS */
} shmt_wire_handle;

/* Parse `buf`: SHMT_OK, or SHMT_WIRE_OTHER (out is then unspecified). */
int32_t shmt_wire_parse(const uint8_t *buf, uint64_t nbytes, shmt_wire_handle *out);
/* Write the TensorHandle protobuf writes for these fields (proto3: zero and empty fields
 * omitted, shm always present, shape packed) into out[0, cap): its length, or SHMT_EINVAL when
 * it does not fit. `shape`: `ndim` little-endian uint64s. */
int64_t shmt_wire_write(uint8_t *out, uint64_t cap, const uint8_t *name, uint64_t name_len, uint64_t offset,
                        uint64_t nbytes, const uint8_t *owner, uint64_t owner_len, uint64_t generation,
                        const uint8_t *instance, uint64_t instance_len, uint64_t slot, const uint8_t *dtype,
                        uint64_t dtype_len, const uint8_t *shape, uint64_t ndim, const uint8_t *digest,
                        uint64_t digest_len, const uint8_t *token, uint64_t token_len);
/* Bytes per element of the vLLM dtype named name[0, len) (shmtransport.tensors.DTYPES, checked
 * equal by tests/test_wire_native.py); 0 for a name that is not one. */
uint64_t shmt_dtype_itemsize(const uint8_t *name, uint64_t len);
/* A consumer's acquire from the handle's bytes in one call: parse `buf`; if it names an object
 * of this table (slot set, segment `name`, daemon `instance`, no commit token, inside the arena's
 * `arena_nbytes`) whose dtype and shape make exactly its size (as shmtransport.tensors.
 * tensor_nbytes counts: a zero-size tensor occupies 1 byte), shmt_slot_acquire it with `bit`.
 * Returns SHMT_WIRE_OTHER when the handle is not one this call takes (the caller takes the
 * general path, which names what is wrong), else shmt_slot_acquire's status; `out` holds the
 * parsed handle whenever the result is not SHMT_WIRE_OTHER. */
int32_t shmt_wire_acquire(const uint8_t *buf, uint64_t nbytes, const uint8_t *name, uint64_t name_len,
                          const uint8_t *instance, uint64_t instance_len, uint64_t arena_nbytes, uint8_t *table,
                          uint8_t *holds, uint64_t nslots, uint32_t bit, shmt_wire_handle *out);

/* ---------------------------------------------------------------------------------------------
 * A client's fast lane into its tenant's table (a handoff's hot path: one native call a step).
 *
 * shmt_lane: what every call of a session on one table needs (the table, the session's bit, the
 * ids a handle of this session carries), in shmt_lane_nbytes(nslots) bytes of process-local
 * memory the client allocates zeroed (an anonymous mapping: untouched pages cost nothing), then
 * shmt_lane_init. It also counts a consumer's leases: several leases of one client on one object
 * share its bit, which the last release clears. The counting is thread-safe (a spinlock held for
 * a few loads and stores, never across a call out), so a consumer's acquire and release need no
 * lock of the caller's. Nothing in it is shared with another process.
 * ------------------------------------------------------------------------------------------- */
#define SHMT_LANE_ID_MAX 255 /* the longest segment name, session id or daemon instance id */
#define SHMT_LANE_OUT 41     /* uint64s of a shmt_lease_acquire_wire result: 9, then the dims */
#define SHMT_LANE_CLOSED (-40) /* what _shmt_lane refuses a closed lane's calls with */

typedef struct shmt_lane shmt_lane;

uint64_t shmt_lane_nbytes(uint64_t nslots);
/* SHMT_EINVAL for an id longer than SHMT_LANE_ID_MAX or a misaligned table. */
int32_t shmt_lane_init(shmt_lane *lane, uint8_t *table, uint8_t *holds, uint64_t nslots, uint32_t bit,
                       const uint8_t *name, uint64_t name_len, const uint8_t *owner, uint64_t owner_len,
                       const uint8_t *instance, uint64_t instance_len, uint64_t arena_nbytes);
/* Producer: shmt_grant_place of `nbytes`, then the handle's wire form (shmt_wire_write: the
 * lane's ids, `dtype`, `ndim` little-endian uint64 dims, no digest, no token) into wire[0, cap).
 * out[0..2] as shmt_grant_place's, out[3] = the wire form's length (0 when `wire` is NULL: none
 * is written). A wire form that does not fit in `cap` is SHMT_EINVAL, nothing placed. */
int32_t shmt_lane_place(shmt_lane *lane, shmt_grant_space *g, uint64_t nbytes, const uint8_t *dtype,
                        uint64_t dtype_len, const uint8_t *shape, uint64_t ndim, uint64_t *out, uint8_t *wire,
                        uint64_t cap);
/* Producer: shmt_slot_commit of the object in `index` with the lane's bit. */
int32_t shmt_lane_commit(shmt_lane *lane, uint64_t index, uint64_t generation, uint64_t deadline_ns, int32_t hold);
/* Producer: shmt_grant_release of the grant `g`'s object in `index` with the lane's bit. */
int32_t shmt_lane_release_own(shmt_lane *lane, shmt_grant_space *g, uint64_t index, uint64_t generation,
                              int32_t cancel_handoff, uint64_t *remaining);
/* Consumer: shmt_wire_acquire of `buf` with the lane's table, bit and ids, counted: SHMT_SLOT_OK
 * also when this client holds the object already (one more lease). Else SHMT_WIRE_OTHER (also
 * for an uncommitted loan the daemon placed: its Commit may be in flight, which the daemon's
 * Acquire waits for), or the refusal (nothing taken). Whenever the result is not SHMT_WIRE_OTHER or negative,
 * out[0, SHMT_LANE_OUT) = offset, nbytes, generation, table index, dtype (at, len), digest (at,
 * len), ndim, then the dims. */
int32_t shmt_lease_acquire_wire(shmt_lane *lane, const uint8_t *buf, uint64_t nbytes, uint64_t *out);
/* Consumer: shmt_slot_acquire with the lane's bit, counted as shmt_lease_acquire_wire counts. */
int32_t shmt_lease_acquire(shmt_lane *lane, uint64_t index, uint64_t generation, uint64_t offset,
                           uint64_t nbytes);
/* Consumer: drop one lease; the last clears the bit (shmt_slot_release's status). SHMT_SLOT_NOT_HELD
 * when this client holds no lease on that object. */
int32_t shmt_lease_release(shmt_lane *lane, uint64_t index, uint64_t generation);
/* Leases counted now. */
uint64_t shmt_lease_count(shmt_lane *lane);
/* Drop every lease (a client closing): the objects whose bit it cleared. */
uint64_t shmt_lease_release_all(shmt_lane *lane);

#endif /* SHMT_KERNELS_H */
