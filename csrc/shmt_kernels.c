/*
 * shmt_kernels.c -- see shmt_kernels.h for the contract of every kernel.
 *
 * XXH3 comes from an installed library, linked at build time (csrc/build_native.py): the system
 * libxxhash.so.0, or the XXH symbols exported by the `xxhash` PyPI package's extension. No xxHash
 * source is part of this repository; the few prototypes we call are declared below with the
 * library's ABI (XXH128_hash_t is {uint64 low64, high64}; XXH_errorcode is an int-sized enum).
 */
#include "shmt_kernels.h"

#include <string.h>

/* The object table's words and the packed masks are defined little-endian, and the kernels read
 * them with plain loads: a big-endian build would compute wrong answers, so it must not build. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shmtransport's kernels need a little-endian target"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define SHMT_X86 1
#include <immintrin.h>
#else
#define SHMT_X86 0
#endif

/* ---------------------------------------------------------------------------------------------
 * XXH3 prototypes (ABI of xxHash >= 0.8). The build picks the runtime-dispatching entry points
 * (AVX2/AVX-512 when the CPU has them) when the library exports them.
 * ------------------------------------------------------------------------------------------- */
#if SHMT_HAVE_XXH3
typedef struct { uint64_t low64; uint64_t high64; } shmt_xxh128_t;
typedef struct { unsigned char digest[16]; } shmt_xxh128_canonical_t;

extern shmt_xxh128_t XXH3_128bits(const void *data, size_t len);
extern int XXH3_128bits_reset(struct XXH3_state_s *state);
extern int XXH3_128bits_update(struct XXH3_state_s *state, const void *data, size_t len);
extern shmt_xxh128_t XXH3_128bits_digest(const struct XXH3_state_s *state);
extern void XXH128_canonicalFromHash(shmt_xxh128_canonical_t *dst, shmt_xxh128_t hash);
/* Runtime-dispatching entry points (xxHash built with XXH_DISPATCH): declared weak, so they are
 * NULL where the library does not export them and we fall back to the plain ones. */
extern shmt_xxh128_t XXH3_128bits_dispatch(const void *data, size_t len) __attribute__((weak));
extern int XXH3_128bits_update_dispatch(struct XXH3_state_s *state, const void *data, size_t len)
    __attribute__((weak));

static shmt_xxh128_t shmt_xxh3_oneshot(const void *data, size_t len)
{
    return XXH3_128bits_dispatch ? XXH3_128bits_dispatch(data, len) : XXH3_128bits(data, len);
}

static void shmt_xxh3_update(struct XXH3_state_s *state, const void *data, size_t len)
{
    if (XXH3_128bits_update_dispatch) XXH3_128bits_update_dispatch(state, data, len);
    else XXH3_128bits_update(state, data, len);
}

static void shmt_canonical(shmt_xxh128_t h, uint8_t *out)
{
    shmt_xxh128_canonical_t c;
    XXH128_canonicalFromHash(&c, h); /* big-endian high64 then low64 */
    memcpy(out, c.digest, 16);
}
#endif

int32_t shmt_have_xxh3(void) { return SHMT_HAVE_XXH3; }

/* ---------------------------------------------------------------------------------------------
 * Copies. Non-temporal stores bypass the cache for large destinations (glibc memcpy only does so
 * above ~190 MB). AVX2 when the CPU has it, SSE2 (baseline x86-64) otherwise, memcpy elsewhere.
 * The caller issues the store fence (shmt_sfence) once after a series of NT copies.
 * ------------------------------------------------------------------------------------------- */
#if SHMT_X86
__attribute__((target("avx2"))) static void shmt_copy_nt_avx2(uint8_t *dst, const uint8_t *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31; /* bring dst to 32-byte alignment */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    for (; n >= 128; n -= 128, dst += 128, src += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    memcpy(dst, src, n);
}

static void shmt_copy_nt_sse2(uint8_t *dst, const uint8_t *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}

/* CPU features, looked up once. Relaxed atomics: threads may race to compute the same value, but
 * no load or store of the flag is a data race. */
static int shmt_cpu_avx2(void)
{
    static int cached = -1;
    int value = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (value < 0) {
        __builtin_cpu_init();
        value = __builtin_cpu_supports("avx2") ? 1 : 0;
        __atomic_store_n(&cached, value, __ATOMIC_RELAXED);
    }
    return value;
}

static void shmt_copy_nt(uint8_t *dst, const uint8_t *src, size_t n)
{
    if (shmt_cpu_avx2()) shmt_copy_nt_avx2(dst, src, n);
    else shmt_copy_nt_sse2(dst, src, n);
}

static void shmt_sfence(void) { _mm_sfence(); }

/* AVX2 + BMI1/2 + POPCNT (every x86-64 CPU since 2013): the mask kernels' fast variants. */
#define SHMT_FAST_TARGET __attribute__((target("avx2,bmi,bmi2,popcnt")))
static int shmt_cpu_fast(void)
{
    static int cached = -1;
    int value = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (value < 0) {
        __builtin_cpu_init();
        value = (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
                 __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt")) ? 1 : 0;
        __atomic_store_n(&cached, value, __ATOMIC_RELAXED);
    }
    return value;
}
#else
static void shmt_copy_nt(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }
static void shmt_sfence(void) {}
static int shmt_cpu_avx2(void) { return 0; }
#endif

int32_t shmt_copy(uint8_t *dst, uint64_t dst_nbytes, const uint8_t *src, uint64_t src_nbytes)
{
    if (dst_nbytes != src_nbytes) return SHMT_EINVAL;
    if (src_nbytes == 0) return SHMT_OK;
    if (dst == NULL || src == NULL) return SHMT_EINVAL;
    if (src_nbytes >= SHMT_NT_MIN_NBYTES) {
        shmt_copy_nt(dst, src, (size_t)src_nbytes);
        shmt_sfence();
    } else {
        memmove(dst, src, (size_t)src_nbytes);
    }
    return SHMT_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Hashing.
 * ------------------------------------------------------------------------------------------- */
int32_t shmt_xxh3_128(const uint8_t *buf, uint64_t nbytes, uint8_t *out, uint64_t out_nbytes)
{
#if SHMT_HAVE_XXH3
    if (out == NULL || out_nbytes < 16 || (buf == NULL && nbytes)) return SHMT_EINVAL;
    shmt_canonical(shmt_xxh3_oneshot(buf, (size_t)nbytes), out);
    return SHMT_OK;
#else
    (void)buf; (void)nbytes; (void)out; (void)out_nbytes;
    return SHMT_ENOHASH;
#endif
}

int32_t shmt_xxh3_stream_reset(struct XXH3_state_s *state)
{
#if SHMT_HAVE_XXH3
    if (state == NULL) return SHMT_EINVAL;
    XXH3_128bits_reset(state);
    return SHMT_OK;
#else
    (void)state;
    return SHMT_ENOHASH;
#endif
}

int32_t shmt_xxh3_stream_update(struct XXH3_state_s *state, const uint8_t *buf, uint64_t nbytes)
{
#if SHMT_HAVE_XXH3
    if (state == NULL || (buf == NULL && nbytes)) return SHMT_EINVAL;
    if (nbytes) shmt_xxh3_update(state, buf, (size_t)nbytes);
    return SHMT_OK;
#else
    (void)state; (void)buf; (void)nbytes;
    return SHMT_ENOHASH;
#endif
}

int32_t shmt_xxh3_stream_digest(struct XXH3_state_s *state, uint8_t *out, uint64_t out_nbytes)
{
#if SHMT_HAVE_XXH3
    if (state == NULL || out == NULL || out_nbytes < 16) return SHMT_EINVAL;
    shmt_canonical(XXH3_128bits_digest(state), out);
    return SHMT_OK;
#else
    (void)state; (void)out; (void)out_nbytes;
    return SHMT_ENOHASH;
#endif
}

#if SHMT_HAVE_XXH3
/* Hash src[0..n) into the state and copy it to dst, one cache-sized sub-block at a time: the hash
 * pulls the sub-block into L1/L2, the copy then reads it from cache. No fence (caller's job). */
static void shmt_fused_update(struct XXH3_state_s *state, uint8_t *dst, const uint8_t *src, size_t n, int nt)
{
    while (n) {
        size_t b = n < SHMT_FUSED_BLOCK_NBYTES ? n : SHMT_FUSED_BLOCK_NBYTES;
        shmt_xxh3_update(state, src, b);
        if (nt) shmt_copy_nt(dst, src, b);
        else memcpy(dst, src, b);
        dst += b; src += b; n -= b;
    }
}
#endif

int32_t shmt_xxh3_stream_copy_update(struct XXH3_state_s *state, uint8_t *dst, uint64_t dst_nbytes,
                                     const uint8_t *src, uint64_t src_nbytes)
{
#if SHMT_HAVE_XXH3
    if (state == NULL || dst_nbytes != src_nbytes) return SHMT_EINVAL;
    if (src_nbytes == 0) return SHMT_OK;
    if (dst == NULL || src == NULL) return SHMT_EINVAL;
    int nt = src_nbytes >= SHMT_NT_MIN_NBYTES;
    shmt_fused_update(state, dst, src, (size_t)src_nbytes, nt);
    if (nt) shmt_sfence();
    return SHMT_OK;
#else
    (void)state; (void)dst; (void)dst_nbytes; (void)src; (void)src_nbytes;
    return SHMT_ENOHASH;
#endif
}

static uint64_t shmt_tree_nchunks(uint64_t nbytes)
{
    /* not (nbytes + C - 1) / C: that wraps for nbytes within C of UINT64_MAX */
    return nbytes / SHMT_TREE_CHUNK_NBYTES + (nbytes % SHMT_TREE_CHUNK_NBYTES != 0);
}

int32_t shmt_tree_leaves(const uint8_t *buf, uint64_t nbytes, uint64_t first, uint64_t last,
                         uint8_t *out, uint64_t out_nbytes)
{
#if SHMT_HAVE_XXH3
    uint64_t nchunks = shmt_tree_nchunks(nbytes);
    if (first > last || last > nchunks) return SHMT_EINVAL;
    if ((last - first) > out_nbytes / 16) return SHMT_EINVAL;
    if (last > first && (buf == NULL || out == NULL)) return SHMT_EINVAL;
    for (uint64_t i = first; i < last; i++) {
        uint64_t off = i * SHMT_TREE_CHUNK_NBYTES;
        uint64_t len = nbytes - off < SHMT_TREE_CHUNK_NBYTES ? nbytes - off : SHMT_TREE_CHUNK_NBYTES;
        shmt_canonical(shmt_xxh3_oneshot(buf + off, (size_t)len), out + 16 * (i - first));
    }
    return SHMT_OK;
#else
    (void)buf; (void)nbytes; (void)first; (void)last; (void)out; (void)out_nbytes;
    return SHMT_ENOHASH;
#endif
}

int32_t shmt_copy_tree_leaves(struct XXH3_state_s *state, uint8_t *dst, uint64_t dst_nbytes,
                              const uint8_t *src, uint64_t src_nbytes, uint8_t *out, uint64_t out_nbytes)
{
#if SHMT_HAVE_XXH3
    uint64_t nchunks = shmt_tree_nchunks(src_nbytes);
    if (state == NULL || dst_nbytes != src_nbytes) return SHMT_EINVAL;
    if (nchunks > out_nbytes / 16) return SHMT_EINVAL;
    if (src_nbytes == 0) return SHMT_OK;
    if (dst == NULL || src == NULL || out == NULL) return SHMT_EINVAL;
    int nt = src_nbytes >= SHMT_NT_MIN_NBYTES;
    for (uint64_t i = 0; i < nchunks; i++) {
        uint64_t off = i * SHMT_TREE_CHUNK_NBYTES;
        uint64_t len = src_nbytes - off < SHMT_TREE_CHUNK_NBYTES ? src_nbytes - off : SHMT_TREE_CHUNK_NBYTES;
        XXH3_128bits_reset(state);
        shmt_fused_update(state, dst + off, src + off, (size_t)len, nt);
        shmt_canonical(XXH3_128bits_digest(state), out + 16 * i);
    }
    if (nt) shmt_sfence();
    return SHMT_OK;
#else
    (void)state; (void)dst; (void)dst_nbytes; (void)src; (void)src_nbytes; (void)out; (void)out_nbytes;
    return SHMT_ENOHASH;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * Bit masks. Words are read big-endian so that bit i of the mask is bit (63 - i%64) of word i/64:
 * count-leading-zeros then walks the mask in order. Bits at positions >= nbits read as zero.
 *
 * Each kernel has one body (SHMT_INLINE) compiled twice: a baseline x86-64 variant and, on CPUs
 * that have them, an AVX2/BMI2/POPCNT variant (hardware popcount, vectorized stores).
 * ------------------------------------------------------------------------------------------- */
#define SHMT_INLINE static inline __attribute__((always_inline))

static int shmt_mask_ok(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits)
{
    if (nbits > UINT64_MAX - 7) return 0;
    if ((nbits + 7) / 8 > packed_nbytes) return 0;
    if (nbits && packed == NULL) return 0;
    return 1;
}

SHMT_INLINE uint64_t shmt_load_be64(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return __builtin_bswap64(w);
}

/* The last, partial word (nbits % 64 != 0): only bytes < ceil(nbits/8) are read, padding
 * bits are cleared. */
SHMT_INLINE uint64_t shmt_tail_word(const uint8_t *packed, uint64_t nbits)
{
    uint64_t k = nbits / 64, used = (nbits + 7) / 8, w = 0;
    for (uint64_t j = k * 8; j < used; j++) w |= (uint64_t)packed[j] << (56 - 8 * (j - k * 8));
    return w & ~(UINT64_MAX >> (nbits % 64));
}

/* Runs BODY with K = word index and W = word value for every word of the mask, in order. */
#define SHMT_FOR_EACH_WORD(packed, nbits, K, W, ...)                               \
    do {                                                                           \
        uint64_t nfull_ = (nbits) / 64;                                            \
        for (uint64_t K = 0; K < nfull_; K++) {                                    \
            uint64_t W = shmt_load_be64((packed) + 8 * K);                         \
            __VA_ARGS__                                                            \
        }                                                                          \
        if ((nbits) % 64) {                                                        \
            uint64_t K = nfull_;                                                   \
            uint64_t W = shmt_tail_word((packed), (nbits));                        \
            __VA_ARGS__                                                            \
        }                                                                          \
    } while (0)

/* Declares the baseline and fast variants of a kernel body `NAME_body(ARGS)`. */
#if SHMT_X86
#define SHMT_VARIANTS(RET, NAME, PARAMS, ARGS)                                     \
    static RET NAME##_base PARAMS { return NAME##_body ARGS; }                     \
    SHMT_FAST_TARGET static RET NAME##_fast PARAMS { return NAME##_body ARGS; }    \
    static RET NAME##_run PARAMS { return shmt_cpu_fast() ? NAME##_fast ARGS : NAME##_base ARGS; }
#else
#define SHMT_VARIANTS(RET, NAME, PARAMS, ARGS)                                     \
    static RET NAME##_run PARAMS { return NAME##_body ARGS; }
#endif

/* ---- popcount, prefix counts, run counts ---- */
SHMT_INLINE uint64_t shmt_popcount_body(const uint8_t *packed, uint64_t nbits)
{
    uint64_t c = 0;
    SHMT_FOR_EACH_WORD(packed, nbits, k, w, { (void)k; c += (uint64_t)__builtin_popcountll(w); });
    return c;
}
SHMT_VARIANTS(uint64_t, shmt_popcount, (const uint8_t *packed, uint64_t nbits), (packed, nbits))

int64_t shmt_mask_popcount(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    return (int64_t)shmt_popcount_run(packed, nbits);
}

int32_t shmt_mask_window(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                         uint64_t start, uint64_t end, int64_t *out, uint64_t out_len)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    if (start > end || end > nbits || out == NULL || out_len < 2) return SHMT_EINVAL;
    /* a prefix [0, pos) of a mask is itself a valid mask of pos bits */
    uint64_t a = shmt_popcount_run(packed, start);
    uint64_t b = shmt_popcount_run(packed, end);
    out[0] = (int64_t)a;
    out[1] = (int64_t)b;
    return SHMT_OK;
}

SHMT_INLINE uint64_t shmt_count_runs_body(const uint8_t *packed, uint64_t nbits)
{
    uint64_t c = 0, prev = 0;
    SHMT_FOR_EACH_WORD(packed, nbits, k, w, {
        /* explicit prefetch 1 KiB ahead: measured 2x faster on a cold mask (plain popcount is not) */
        if ((k & 7) == 0 && k + 128 < nbits / 64) __builtin_prefetch(packed + 8 * k + 1024);
        uint64_t before = (w >> 1) | (prev << 63); /* bit j holds mask bit j-1 */
        c += (uint64_t)__builtin_popcountll(w & ~before); /* run starts */
        prev = w;
    });
    return c;
}
SHMT_VARIANTS(uint64_t, shmt_count_runs, (const uint8_t *packed, uint64_t nbits), (packed, nbits))

int64_t shmt_mask_count_runs(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    return (int64_t)shmt_count_runs_run(packed, nbits);
}

/* ---- indices ----
 * Byte by byte, branch-free: SHMT_BYTE_POSITIONS[b] packs the positions (0..7, MSB-first) of the
 * set bits of byte b into its bytes 0.. (unused bytes 0). Eight candidate indices are stored per
 * byte and the output cursor advances by popcount(b); the overshoot is overwritten by the next
 * byte. This "fast" store needs 8 slots of room, so the last bytes go through an exact path. */
static const uint64_t SHMT_BYTE_POSITIONS[256] = {
    0x0000000000000000ULL, 0x0000000000000007ULL, 0x0000000000000006ULL, 0x0000000000000706ULL,
    0x0000000000000005ULL, 0x0000000000000705ULL, 0x0000000000000605ULL, 0x0000000000070605ULL,
    0x0000000000000004ULL, 0x0000000000000704ULL, 0x0000000000000604ULL, 0x0000000000070604ULL,
    0x0000000000000504ULL, 0x0000000000070504ULL, 0x0000000000060504ULL, 0x0000000007060504ULL,
    0x0000000000000003ULL, 0x0000000000000703ULL, 0x0000000000000603ULL, 0x0000000000070603ULL,
    0x0000000000000503ULL, 0x0000000000070503ULL, 0x0000000000060503ULL, 0x0000000007060503ULL,
    0x0000000000000403ULL, 0x0000000000070403ULL, 0x0000000000060403ULL, 0x0000000007060403ULL,
    0x0000000000050403ULL, 0x0000000007050403ULL, 0x0000000006050403ULL, 0x0000000706050403ULL,
    0x0000000000000002ULL, 0x0000000000000702ULL, 0x0000000000000602ULL, 0x0000000000070602ULL,
    0x0000000000000502ULL, 0x0000000000070502ULL, 0x0000000000060502ULL, 0x0000000007060502ULL,
    0x0000000000000402ULL, 0x0000000000070402ULL, 0x0000000000060402ULL, 0x0000000007060402ULL,
    0x0000000000050402ULL, 0x0000000007050402ULL, 0x0000000006050402ULL, 0x0000000706050402ULL,
    0x0000000000000302ULL, 0x0000000000070302ULL, 0x0000000000060302ULL, 0x0000000007060302ULL,
    0x0000000000050302ULL, 0x0000000007050302ULL, 0x0000000006050302ULL, 0x0000000706050302ULL,
    0x0000000000040302ULL, 0x0000000007040302ULL, 0x0000000006040302ULL, 0x0000000706040302ULL,
    0x0000000005040302ULL, 0x0000000705040302ULL, 0x0000000605040302ULL, 0x0000070605040302ULL,
    0x0000000000000001ULL, 0x0000000000000701ULL, 0x0000000000000601ULL, 0x0000000000070601ULL,
    0x0000000000000501ULL, 0x0000000000070501ULL, 0x0000000000060501ULL, 0x0000000007060501ULL,
    0x0000000000000401ULL, 0x0000000000070401ULL, 0x0000000000060401ULL, 0x0000000007060401ULL,
    0x0000000000050401ULL, 0x0000000007050401ULL, 0x0000000006050401ULL, 0x0000000706050401ULL,
    0x0000000000000301ULL, 0x0000000000070301ULL, 0x0000000000060301ULL, 0x0000000007060301ULL,
    0x0000000000050301ULL, 0x0000000007050301ULL, 0x0000000006050301ULL, 0x0000000706050301ULL,
    0x0000000000040301ULL, 0x0000000007040301ULL, 0x0000000006040301ULL, 0x0000000706040301ULL,
    0x0000000005040301ULL, 0x0000000705040301ULL, 0x0000000605040301ULL, 0x0000070605040301ULL,
    0x0000000000000201ULL, 0x0000000000070201ULL, 0x0000000000060201ULL, 0x0000000007060201ULL,
    0x0000000000050201ULL, 0x0000000007050201ULL, 0x0000000006050201ULL, 0x0000000706050201ULL,
    0x0000000000040201ULL, 0x0000000007040201ULL, 0x0000000006040201ULL, 0x0000000706040201ULL,
    0x0000000005040201ULL, 0x0000000705040201ULL, 0x0000000605040201ULL, 0x0000070605040201ULL,
    0x0000000000030201ULL, 0x0000000007030201ULL, 0x0000000006030201ULL, 0x0000000706030201ULL,
    0x0000000005030201ULL, 0x0000000705030201ULL, 0x0000000605030201ULL, 0x0000070605030201ULL,
    0x0000000004030201ULL, 0x0000000704030201ULL, 0x0000000604030201ULL, 0x0000070604030201ULL,
    0x0000000504030201ULL, 0x0000070504030201ULL, 0x0000060504030201ULL, 0x0007060504030201ULL,
    0x0000000000000000ULL, 0x0000000000000700ULL, 0x0000000000000600ULL, 0x0000000000070600ULL,
    0x0000000000000500ULL, 0x0000000000070500ULL, 0x0000000000060500ULL, 0x0000000007060500ULL,
    0x0000000000000400ULL, 0x0000000000070400ULL, 0x0000000000060400ULL, 0x0000000007060400ULL,
    0x0000000000050400ULL, 0x0000000007050400ULL, 0x0000000006050400ULL, 0x0000000706050400ULL,
    0x0000000000000300ULL, 0x0000000000070300ULL, 0x0000000000060300ULL, 0x0000000007060300ULL,
    0x0000000000050300ULL, 0x0000000007050300ULL, 0x0000000006050300ULL, 0x0000000706050300ULL,
    0x0000000000040300ULL, 0x0000000007040300ULL, 0x0000000006040300ULL, 0x0000000706040300ULL,
    0x0000000005040300ULL, 0x0000000705040300ULL, 0x0000000605040300ULL, 0x0000070605040300ULL,
    0x0000000000000200ULL, 0x0000000000070200ULL, 0x0000000000060200ULL, 0x0000000007060200ULL,
    0x0000000000050200ULL, 0x0000000007050200ULL, 0x0000000006050200ULL, 0x0000000706050200ULL,
    0x0000000000040200ULL, 0x0000000007040200ULL, 0x0000000006040200ULL, 0x0000000706040200ULL,
    0x0000000005040200ULL, 0x0000000705040200ULL, 0x0000000605040200ULL, 0x0000070605040200ULL,
    0x0000000000030200ULL, 0x0000000007030200ULL, 0x0000000006030200ULL, 0x0000000706030200ULL,
    0x0000000005030200ULL, 0x0000000705030200ULL, 0x0000000605030200ULL, 0x0000070605030200ULL,
    0x0000000004030200ULL, 0x0000000704030200ULL, 0x0000000604030200ULL, 0x0000070604030200ULL,
    0x0000000504030200ULL, 0x0000070504030200ULL, 0x0000060504030200ULL, 0x0007060504030200ULL,
    0x0000000000000100ULL, 0x0000000000070100ULL, 0x0000000000060100ULL, 0x0000000007060100ULL,
    0x0000000000050100ULL, 0x0000000007050100ULL, 0x0000000006050100ULL, 0x0000000706050100ULL,
    0x0000000000040100ULL, 0x0000000007040100ULL, 0x0000000006040100ULL, 0x0000000706040100ULL,
    0x0000000005040100ULL, 0x0000000705040100ULL, 0x0000000605040100ULL, 0x0000070605040100ULL,
    0x0000000000030100ULL, 0x0000000007030100ULL, 0x0000000006030100ULL, 0x0000000706030100ULL,
    0x0000000005030100ULL, 0x0000000705030100ULL, 0x0000000605030100ULL, 0x0000070605030100ULL,
    0x0000000004030100ULL, 0x0000000704030100ULL, 0x0000000604030100ULL, 0x0000070604030100ULL,
    0x0000000504030100ULL, 0x0000070504030100ULL, 0x0000060504030100ULL, 0x0007060504030100ULL,
    0x0000000000020100ULL, 0x0000000007020100ULL, 0x0000000006020100ULL, 0x0000000706020100ULL,
    0x0000000005020100ULL, 0x0000000705020100ULL, 0x0000000605020100ULL, 0x0000070605020100ULL,
    0x0000000004020100ULL, 0x0000000704020100ULL, 0x0000000604020100ULL, 0x0000070604020100ULL,
    0x0000000504020100ULL, 0x0000070504020100ULL, 0x0000060504020100ULL, 0x0007060504020100ULL,
    0x0000000003020100ULL, 0x0000000703020100ULL, 0x0000000603020100ULL, 0x0000070603020100ULL,
    0x0000000503020100ULL, 0x0000070503020100ULL, 0x0000060503020100ULL, 0x0007060503020100ULL,
    0x0000000403020100ULL, 0x0000070403020100ULL, 0x0000060403020100ULL, 0x0007060403020100ULL,
    0x0000050403020100ULL, 0x0007050403020100ULL, 0x0006050403020100ULL, 0x0706050403020100ULL,
};

SHMT_INLINE void shmt_indices_exact(uint8_t b, int64_t base, int64_t *out, uint64_t *j)
{
    uint64_t pos = SHMT_BYTE_POSITIONS[b];
    int n = __builtin_popcount(b);
    for (int k = 0; k < n; k++) out[*j + (uint64_t)k] = base + (int64_t)((pos >> (8 * k)) & 0xFF);
    *j += (uint64_t)n;
}

SHMT_INLINE int32_t shmt_indices_body(const uint8_t *packed, uint64_t nbits, int64_t *out, uint64_t out_len)
{
    uint64_t full = nbits / 8, j = 0, i = 0;
    /* fast path: unconditional 8-slot stores while at least 8 slots remain */
    for (; i < full && out_len - j >= 8; i++) {
        uint64_t pos = SHMT_BYTE_POSITIONS[packed[i]];
        int64_t *o = out + j, base = (int64_t)(8 * i);
        for (int k = 0; k < 8; k++) o[k] = base + (int64_t)((pos >> (8 * k)) & 0xFF);
        j += (uint64_t)__builtin_popcount(packed[i]);
    }
    for (; i < full; i++) {
        if ((uint64_t)__builtin_popcount(packed[i]) > out_len - j) return SHMT_EINVAL;
        shmt_indices_exact(packed[i], (int64_t)(8 * i), out, &j);
    }
    if (nbits % 8) {
        uint8_t last = (uint8_t)(packed[full] & (0xFF00u >> (nbits % 8))); /* drop padding bits */
        if ((uint64_t)__builtin_popcount(last) > out_len - j) return SHMT_EINVAL;
        shmt_indices_exact(last, (int64_t)(8 * full), out, &j);
    }
    return j == out_len ? SHMT_OK : SHMT_EINVAL;
}

#if SHMT_X86
/* 8 candidate indices of byte b (base = its first bit position) at o[0..8). */
SHMT_FAST_TARGET static inline void shmt_indices_put8(int64_t *o, uint8_t b, __m256i base)
{
    __m128i pos = _mm_cvtsi64_si128((long long)SHMT_BYTE_POSITIONS[b]);
    _mm256_storeu_si256((__m256i *)o, _mm256_add_epi64(_mm256_cvtepu8_epi64(pos), base));
    _mm256_storeu_si256((__m256i *)(o + 4), _mm256_add_epi64(_mm256_cvtepu8_epi64(_mm_srli_si128(pos, 4)), base));
}

SHMT_FAST_TARGET static int32_t shmt_indices_avx2(const uint8_t *packed, uint64_t nbits, int64_t *out,
                                                  uint64_t out_len)
{
    uint64_t full = nbits / 8, j = 0, i = 0;
    __m256i base = _mm256_setzero_si256();
    const __m256i eight = _mm256_set1_epi64x(8);
    for (; i < full && out_len - j >= 8; i++) {
        shmt_indices_put8(out + j, packed[i], base);
        base = _mm256_add_epi64(base, eight);
        j += (uint64_t)__builtin_popcount(packed[i]);
    }
    /* the exact path finishes the last bytes */
    for (; i < full; i++) {
        if ((uint64_t)__builtin_popcount(packed[i]) > out_len - j) return SHMT_EINVAL;
        shmt_indices_exact(packed[i], (int64_t)(8 * i), out, &j);
    }
    if (nbits % 8) {
        uint8_t last = (uint8_t)(packed[full] & (0xFF00u >> (nbits % 8)));
        if ((uint64_t)__builtin_popcount(last) > out_len - j) return SHMT_EINVAL;
        shmt_indices_exact(last, (int64_t)(8 * full), out, &j);
    }
    return j == out_len ? SHMT_OK : SHMT_EINVAL;
}
#endif

int32_t shmt_mask_indices(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                          int64_t *out, uint64_t out_len)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    if (out == NULL && out_len) return SHMT_EINVAL;
    /* writes stay below out_len by construction; a count mismatch is reported at the end */
#if SHMT_X86
    if (shmt_cpu_fast()) return shmt_indices_avx2(packed, nbits, out, out_len);
#endif
    return shmt_indices_body(packed, nbits, out, out_len);
}

/* ---- runs ----
 * Words are turned LSB-first (bit j = mask bit 64k + j: bytes in memory order, bits reversed
 * within each byte) so that count-trailing-zeros / clear-lowest-bit walk them in order. Per word:
 * run starts = set bits whose previous bit is clear, run ends = set bits whose next bit is clear
 * (across word boundaries). A start s goes to out[2r], the end e to out[2r + 1] as the length
 * e + 1 - s. While 64 runs of room remain, the first two starts/ends of a word are stored
 * unconditionally (branch-free for typical masks; the overshoot is overwritten later); words with
 * more take a loop. Near the end of `out` every store is checked. */
#define SHMT_TOP 0x8000000000000000ULL /* OR-ed in so that ctz of an empty word is defined (63) */

/* Reverses the bits within each byte: memory-order bytes, MSB-first bits -> LSB-first word. */
SHMT_INLINE uint64_t shmt_rev_bits_in_bytes(uint64_t x)
{
    x = ((x >> 1) & 0x5555555555555555ULL) | ((x & 0x5555555555555555ULL) << 1);
    x = ((x >> 2) & 0x3333333333333333ULL) | ((x & 0x3333333333333333ULL) << 2);
    return ((x >> 4) & 0x0F0F0F0F0F0F0F0FULL) | ((x & 0x0F0F0F0F0F0F0F0FULL) << 4);
}

/* LSB-first words [k0, k0 + m) into lsb[] (m <= SHMT_RUNS_BLOCK + 1); the full-word loop has no
 * branch so it vectorizes. */
#define SHMT_RUNS_BLOCK 32
SHMT_INLINE void shmt_lsb_words(const uint8_t *packed, uint64_t nbits, uint64_t k0, uint64_t m, uint64_t *lsb)
{
    uint64_t nfull = nbits / 64;
    uint64_t mf = k0 >= nfull ? 0 : (nfull - k0 < m ? nfull - k0 : m);
    for (uint64_t t = 0; t < mf; t++) {
        uint64_t x;
        memcpy(&x, packed + 8 * (k0 + t), 8); /* little-endian load: byte order = memory order */
        lsb[t] = shmt_rev_bits_in_bytes(x);
    }
    if (mf < m) lsb[mf] = shmt_rev_bits_in_bytes(__builtin_bswap64(shmt_tail_word(packed, nbits)));
}

/* Stores base + position of each set bit of x (minus out[2t - 1], the run's start, when `minus`)
 * at out[2*(*j)], out[2*(*j + 1)], ...; `room` says two unconditional stores are safe. Returns 0
 * when `cap` entries would be exceeded. */
SHMT_INLINE int shmt_put_positions(uint64_t x, int64_t base, int64_t *out, uint64_t *j, uint64_t cap,
                                   int room, int minus)
{
    uint64_t n = (uint64_t)__builtin_popcountll(x);
    int64_t *o = out + 2 * *j;
    if (room) {
        int64_t c0 = __builtin_ctzll(x | SHMT_TOP);
        uint64_t x1 = x & (x - 1);
        int64_t c1 = __builtin_ctzll(x1 | SHMT_TOP);
        o[0] = base + c0 - (minus ? o[-1] : 0);
        o[2] = base + c1 - (minus ? o[1] : 0);
        if (n > 2) {
            uint64_t r = x1 & (x1 - 1);
            for (uint64_t t = 2; t < n; t++, r &= r - 1)
                o[2 * t] = base + __builtin_ctzll(r) - (minus ? o[2 * t - 1] : 0);
        }
    } else {
        if (n > cap - *j) return 0;
        for (uint64_t t = 0; t < n; t++, x &= x - 1)
            o[2 * t] = base + __builtin_ctzll(x) - (minus ? o[2 * t - 1] : 0);
    }
    *j += n;
    return 1;
}

SHMT_INLINE int32_t shmt_runs_body(const uint8_t *packed, uint64_t nbits, int64_t *out, uint64_t out_len)
{
    uint64_t cap = out_len / 2, nw = (nbits + 63) / 64, js = 0, je = 0, prev = 0;
    uint64_t lsb[SHMT_RUNS_BLOCK + 1];
    for (uint64_t k0 = 0; k0 < nw; k0 += SHMT_RUNS_BLOCK) {
        uint64_t nb = nw - k0 < SHMT_RUNS_BLOCK ? nw - k0 : SHMT_RUNS_BLOCK; /* words of this block */
        uint64_t m = nw - k0 < SHMT_RUNS_BLOCK + 1 ? nw - k0 : SHMT_RUNS_BLOCK + 1; /* + lookahead */
        shmt_lsb_words(packed, nbits, k0, m, lsb);
        if (k0 + 8 * SHMT_RUNS_BLOCK < nbits / 64) __builtin_prefetch(packed + 8 * (k0 + 8 * SHMT_RUNS_BLOCK));
        for (uint64_t t = 0; t < nb; t++) {
            uint64_t cur = lsb[t], next = t + 1 < m ? lsb[t + 1] : 0, k = k0 + t;
            uint64_t starts = cur & ~((cur << 1) | (prev >> 63));
            uint64_t ends = cur & ~((cur >> 1) | (next << 63));
            int room = cap - js >= 64; /* at most 32 starts per word; je <= js */
            if (!shmt_put_positions(starts, (int64_t)(64 * k), out, &js, cap, room, 0)) return SHMT_EINVAL;
            /* ends: run r's start is already at out[2r] (same or earlier word) */
            if (!shmt_put_positions(ends, (int64_t)(64 * k + 1), out + 1, &je, cap, room, 1)) return SHMT_EINVAL;
            prev = cur;
        }
    }
    return (js == cap && je == cap) ? SHMT_OK : SHMT_EINVAL;
}
SHMT_VARIANTS(int32_t, shmt_runs, (const uint8_t *packed, uint64_t nbits, int64_t *out, uint64_t out_len),
              (packed, nbits, out, out_len))

int32_t shmt_mask_runs(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                       int64_t *out, uint64_t out_len)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    if ((out == NULL && out_len) || out_len % 2) return SHMT_EINVAL;
    return shmt_runs_run(packed, nbits, out, out_len);
}

/* ---- cumsum: per byte, spread its bits to 8 bytes (0/1), prefix-sum them with one multiply ---- */
SHMT_INLINE uint64_t shmt_spread_byte(uint8_t b)
{
    /* byte k of the result = bit (7-k) of b, as 0 or 1 */
    uint64_t x = (uint64_t)b * 0x0101010101010101ULL;
    x &= 0x0102040810204080ULL;
    return ((x + 0x7f7f7f7f7f7f7f7fULL) >> 7) & 0x0101010101010101ULL;
}

SHMT_INLINE void shmt_cumsum_body(const uint8_t *packed, uint64_t nbits, int64_t *out)
{
    uint64_t full = nbits / 8;
    int64_t c = 0;
    for (uint64_t i = 0; i < full; i++) {
        uint64_t pre = shmt_spread_byte(packed[i]) * 0x0101010101010101ULL; /* byte k = sum of bits 0..k */
        int64_t *o = out + 8 * i;
        for (int k = 0; k < 8; k++) o[k] = c + (int64_t)((pre >> (8 * k)) & 0xFF);
        c += (int64_t)(pre >> 56);
    }
    for (uint64_t i = full * 8; i < nbits; i++) {
        c += (packed[i / 8] >> (7 - i % 8)) & 1;
        out[i] = c;
    }
}
SHMT_VARIANTS(void, shmt_cumsum, (const uint8_t *packed, uint64_t nbits, int64_t *out), (packed, nbits, out))

int32_t shmt_mask_cumsum(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                         int64_t *out, uint64_t out_len)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    if (out_len != nbits || (out == NULL && out_len)) return SHMT_EINVAL;
    shmt_cumsum_run(packed, nbits, out);
    return SHMT_OK;
}

/* ---- unpack: one output byte (0 or 1) per bit ---- */
static void shmt_unpack_bytes_scalar(const uint8_t *packed, uint64_t nbytes, uint8_t *out)
{
    for (uint64_t i = 0; i < nbytes; i++) {
        uint64_t x = shmt_spread_byte(packed[i]);
        memcpy(out + 8 * i, &x, 8); /* little-endian: byte k of x is output k */
    }
}

#if SHMT_X86
SHMT_FAST_TARGET static uint64_t shmt_unpack_bytes_avx2(const uint8_t *packed, uint64_t nbytes, uint8_t *out)
{
    /* 4 input bytes -> 32 output bytes: output byte k takes input byte k/8, bit 7 - k%8 */
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x((long long)0x0102040810204080ULL);
    const __m256i one = _mm256_set1_epi8(1);
    uint64_t i = 0;
    for (; i + 8 <= nbytes; i += 8) { /* 8 bytes in, 64 out per iteration */
        uint32_t v0, v1;
        memcpy(&v0, packed + i, 4);
        memcpy(&v1, packed + i + 4, 4);
        __m256i x0 = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v0), shuf);
        __m256i x1 = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v1), shuf);
        x0 = _mm256_cmpeq_epi8(_mm256_and_si256(x0, bits), bits);
        x1 = _mm256_cmpeq_epi8(_mm256_and_si256(x1, bits), bits);
        _mm256_storeu_si256((__m256i *)(out + 8 * i), _mm256_and_si256(x0, one));
        _mm256_storeu_si256((__m256i *)(out + 8 * i + 32), _mm256_and_si256(x1, one));
    }
    for (; i + 4 <= nbytes; i += 4) {
        uint32_t v;
        memcpy(&v, packed + i, 4);
        __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf);
        x = _mm256_cmpeq_epi8(_mm256_and_si256(x, bits), bits);
        _mm256_storeu_si256((__m256i *)(out + 8 * i), _mm256_and_si256(x, one));
    }
    return i;
}
#endif

int32_t shmt_mask_unpack(const uint8_t *packed, uint64_t packed_nbytes, uint64_t nbits,
                         uint8_t *out, uint64_t out_nbytes)
{
    if (!shmt_mask_ok(packed, packed_nbytes, nbits)) return SHMT_EINVAL;
    if (out_nbytes != nbits || (out == NULL && nbits)) return SHMT_EINVAL;
    uint64_t full = nbits / 8, done = 0;
#if SHMT_X86
    if (shmt_cpu_fast()) done = shmt_unpack_bytes_avx2(packed, full, out);
#endif
    shmt_unpack_bytes_scalar(packed + done, full - done, out + 8 * done);
    for (uint64_t i = full * 8; i < nbits; i++) out[i] = (packed[i / 8] >> (7 - i % 8)) & 1u;
    return SHMT_OK;
}

/* ---- pack: 8 bools -> 1 byte, MSB-first; padding bits of the last byte are zero ---- */
int32_t shmt_mask_pack(const uint8_t *bools, uint64_t nbits, uint8_t *out, uint64_t out_nbytes)
{
    if (nbits > UINT64_MAX - 7 || out_nbytes != (nbits + 7) / 8) return SHMT_EINVAL;
    if (nbits && (bools == NULL || out == NULL)) return SHMT_EINVAL;
    uint64_t full = nbits / 8;
    for (uint64_t i = 0; i < full; i++) {
        uint64_t x;
        memcpy(&x, bools + 8 * i, 8);
        /* nonzero byte -> 0x01, then gather byte k's bit into bit 7-k of the top byte */
        x = ((x & 0x7f7f7f7f7f7f7f7fULL) + 0x7f7f7f7f7f7f7f7fULL) | x;
        x = (x >> 7) & 0x0101010101010101ULL;
        out[i] = (uint8_t)((x * 0x8040201008040201ULL) >> 56);
    }
    if (nbits % 8) {
        uint8_t b = 0;
        for (uint64_t i = full * 8; i < nbits; i++)
            if (bools[i]) b |= (uint8_t)(0x80u >> (i % 8));
        out[full] = b;
    }
    return SHMT_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Object table. Every change of `holders` is one atomic read-modify-write (seq_cst), so any
 * process may die between any two of them: the daemon clears a dead session's bit and nothing
 * else is ever half-done (see docs/objects.md for the window analysis of each kernel).
 * ------------------------------------------------------------------------------------------- */
#define SHMT_BIT(b) (1ULL << (b))
#define SHMT_HANDOFF SHMT_BIT(SHMT_HOLDER_HANDOFF)

_Static_assert(sizeof(shmt_slot) == SHMT_SLOT_NBYTES, "a slot is one cache line");
_Static_assert(sizeof(shmt_hold) == SHMT_SLOT_NBYTES, "a holders word has its cache line");

static int shmt_aligned(const uint8_t *p) { return p && ((uintptr_t)p % SHMT_SLOT_NBYTES) == 0; }

static shmt_slot *shmt_slot_at(uint8_t *table, uint64_t nslots, uint64_t index)
{
    if (!shmt_aligned(table) || index >= nslots) return NULL;
    return (shmt_slot *)(table + index * SHMT_SLOT_NBYTES);
}

static uint64_t *shmt_holders_at(uint8_t *holds, uint64_t nslots, uint64_t index)
{
    if (!shmt_aligned(holds) || index >= nslots) return NULL;
    return &((shmt_hold *)(holds + index * SHMT_SLOT_NBYTES))->holders;
}

static uint64_t shmt_load(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

int32_t shmt_slot_publish(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t offset,
                          uint64_t nbytes, uint32_t bit, uint64_t *generation)
{
    shmt_slot *slot = shmt_slot_at(table, nslots, index);
    uint64_t *holders = shmt_holders_at(holds, nslots, index);
    if (!slot || !holders || !generation || bit > SHMT_HOLDER_PROXY || nbytes == 0) return SHMT_EINVAL;
    if (shmt_load(holders) != 0) return SHMT_SLOT_ALREADY;
    uint64_t gen = __atomic_load_n(&slot->generation, __ATOMIC_RELAXED) + 1;
    /* The fields are written before the object becomes live (holders != 0): an acquirer that
     * sees our bit and then this generation also sees this offset, size and state. */
    __atomic_store_n(&slot->generation, gen, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->offset, offset, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->nbytes, nbytes, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->state, SHMT_SLOT_LOANED, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->deadline_ns, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->owner, bit, __ATOMIC_RELAXED);
    uint64_t expected = 0;
    if (!__atomic_compare_exchange_n(holders, &expected, SHMT_BIT(bit), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return SHMT_SLOT_ALREADY; /* only a corrupted table gets here: holders == 0 is terminal */
    *generation = gen;
    return SHMT_SLOT_OK;
}

int32_t shmt_slot_commit(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t generation,
                         uint32_t bit, uint64_t deadline_ns, int32_t hold)
{
    shmt_slot *slot = shmt_slot_at(table, nslots, index);
    uint64_t *holders = shmt_holders_at(holds, nslots, index);
    if (!slot || !holders || bit > SHMT_HOLDER_PROXY) return SHMT_EINVAL;
    if (!(shmt_load(holders) & SHMT_BIT(bit)) || shmt_load(&slot->generation) != generation)
        return SHMT_SLOT_NOT_HELD;
    if (__atomic_load_n(&slot->state, __ATOMIC_RELAXED) != SHMT_SLOT_LOANED) return SHMT_SLOT_ALREADY;
    __atomic_store_n(&slot->deadline_ns, deadline_ns, __ATOMIC_RELAXED);
    /* Hand-off bit before the state: an acquirer that sees COMMITTED also finds the bit to drop. */
    __atomic_fetch_or(holders, SHMT_HANDOFF, __ATOMIC_SEQ_CST);
    __atomic_store_n(&slot->state, hold ? SHMT_SLOT_HELD : SHMT_SLOT_COMMITTED, __ATOMIC_RELEASE);
    return SHMT_SLOT_OK;
}

int32_t shmt_slot_acquire(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t generation,
                          uint64_t offset, uint64_t nbytes, uint32_t bit)
{
    const shmt_slot *slot = shmt_slot_at(table, nslots, index); /* read-only to consumers */
    uint64_t *holders = shmt_holders_at(holds, nslots, index);
    if (!slot || !holders || bit > SHMT_HOLDER_PROXY) return SHMT_EINVAL;
    uint64_t current = shmt_load(&slot->generation);
    if (generation == 0 || generation > current) return SHMT_SLOT_UNKNOWN;
    if (current != generation) return SHMT_SLOT_STALE;
    uint64_t held = shmt_load(holders);
    int already = 0; /* our bit was set before: the object is checked, nothing is taken */
    do {
        if (held == 0) return SHMT_SLOT_STALE; /* dead: may already be reused */
        if (held & SHMT_BIT(bit)) {
            already = 1;
            break;
        }
    } while (!__atomic_compare_exchange_n(holders, &held, held | SHMT_BIT(bit), 1, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST));
    /* Our bit keeps whatever object is in the slot now alive. If that is not the one named (the
     * slot was freed and reused between the first check and the exchange), only a free was
     * delayed: take the bit back and refuse. */
    int32_t status = SHMT_SLOT_OK;
    /* seq_cst, as shmt_slot_retire's store and load: one of us sees the other (Dekker). */
    uint64_t state = __atomic_load_n(&slot->state, __ATOMIC_SEQ_CST);
    if (shmt_load(&slot->generation) != generation)
        status = SHMT_SLOT_STALE;
    else if (state == SHMT_SLOT_LOANED)
        status = SHMT_SLOT_NOT_COMMITTED;
    else if (state != SHMT_SLOT_COMMITTED && state != SHMT_SLOT_HELD)
        status = SHMT_SLOT_STALE; /* retired: its bytes may be another object's now */
    else if (__atomic_load_n(&slot->offset, __ATOMIC_RELAXED) != offset ||
             __atomic_load_n(&slot->nbytes, __ATOMIC_RELAXED) != nbytes)
        status = SHMT_SLOT_MISMATCH;
    if (status != SHMT_SLOT_OK) {
        if (!already) __atomic_fetch_and(holders, ~SHMT_BIT(bit), __ATOMIC_SEQ_CST);
        return status;
    }
    if (already) return SHMT_SLOT_ALREADY;
    if (state == SHMT_SLOT_COMMITTED) /* the first acquire takes the hand-off over */
        __atomic_fetch_and(holders, ~SHMT_HANDOFF, __ATOMIC_SEQ_CST);
    return SHMT_SLOT_OK;
}

int32_t shmt_slot_release(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t generation,
                          uint32_t bit, int32_t cancel_handoff, uint64_t *remaining)
{
    const shmt_slot *slot = shmt_slot_at(table, nslots, index); /* read-only to consumers */
    uint64_t *holders = shmt_holders_at(holds, nslots, index);
    if (!slot || !holders || !remaining || bit > SHMT_HOLDER_PROXY) return SHMT_EINVAL;
    /* While we hold the bit the slot cannot be reused, so the generation check is exact. */
    uint64_t held = shmt_load(holders);
    if (!(held & SHMT_BIT(bit)) || shmt_load(&slot->generation) != generation) return SHMT_SLOT_NOT_HELD;
    uint64_t drop = SHMT_BIT(bit) | (cancel_handoff ? SHMT_HANDOFF : 0);
    uint64_t before = __atomic_fetch_and(holders, ~drop, __ATOMIC_SEQ_CST);
    *remaining = before & ~drop;
    return SHMT_SLOT_OK;
}

int32_t shmt_slot_retire(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index)
{
    shmt_slot *slot = shmt_slot_at(table, nslots, index);
    uint64_t *holders = shmt_holders_at(holds, nslots, index);
    if (!slot || !holders) return SHMT_EINVAL;
    if (shmt_load(holders) != 0) return SHMT_SLOT_ALREADY;
    __atomic_store_n(&slot->state, SHMT_SLOT_FREE, __ATOMIC_SEQ_CST);
    /* An acquirer whose exchange came before the FREE store may have checked the old state: its
     * bit is still in the word (an honest one takes it back only after its checks). One whose
     * exchange comes after reads FREE and refuses. So a word still 0 now means nobody holds it. */
    if (__atomic_load_n(holders, __ATOMIC_SEQ_CST) != 0) return SHMT_SLOT_ALREADY;
    /* The daemon pins before its acquire's exchange and re-check: if that re-check saw a state
     * other than FREE, this load sees its pin. */
    if (__atomic_load_n(&slot->daemon_pin, __ATOMIC_SEQ_CST) != 0) return SHMT_SLOT_ALREADY;
    return SHMT_SLOT_OK;
}

int32_t shmt_slot_pin(uint8_t *table, uint64_t nslots, uint64_t index, uint64_t pinned)
{
    shmt_slot *slot = shmt_slot_at(table, nslots, index);
    if (!slot || pinned > 1) return SHMT_EINVAL;
    __atomic_store_n(&slot->daemon_pin, pinned, __ATOMIC_SEQ_CST);
    return SHMT_SLOT_OK;
}

int32_t shmt_slot_expire(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index, uint64_t now_ns,
                         int32_t *freed)
{
    const shmt_slot *slot = shmt_slot_at(table, nslots, index);
    uint64_t *holders = shmt_holders_at(holds, nslots, index);
    if (!slot || !holders || !freed) return SHMT_EINVAL;
    *freed = 0;
    uint64_t held = shmt_load(holders);
    do {
        if (!(held & SHMT_HANDOFF)) return SHMT_SLOT_NOT_HELD;
        /* Read after `held`: a slot reused since has no hand-off bit until its own commit, which
         * writes its own deadline first. */
        if (__atomic_load_n(&slot->deadline_ns, __ATOMIC_ACQUIRE) > now_ns) return SHMT_SLOT_ALREADY;
    } while (!__atomic_compare_exchange_n(holders, &held, held & ~SHMT_HANDOFF, 1, __ATOMIC_SEQ_CST,
                                          __ATOMIC_SEQ_CST));
    *freed = (held & ~SHMT_HANDOFF) == 0;
    return SHMT_SLOT_OK;
}

int32_t shmt_slots_clear_bit(uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t first, uint64_t last,
                             uint32_t bit, uint64_t *out, uint64_t out_len)
{
    if (!shmt_aligned(table) || !shmt_aligned(holds) || !out || out_len < 3 || first > last || last > nslots ||
        bit > SHMT_HOLDER_PROXY)
        return SHMT_EINVAL;
    uint64_t held = 0, freed = 0, freed_nbytes = 0, mask = SHMT_BIT(bit);
    for (uint64_t i = first; i < last; i++) {
        uint64_t *holders = &((shmt_hold *)(holds + i * SHMT_SLOT_NBYTES))->holders;
        if (!(__atomic_load_n(holders, __ATOMIC_RELAXED) & mask)) continue;
        uint64_t before = __atomic_fetch_and(holders, ~mask, __ATOMIC_SEQ_CST);
        if (!(before & mask)) continue;
        held++;
        if ((before & ~mask) == 0) {
            freed++;
            freed_nbytes += __atomic_load_n(&((shmt_slot *)(table + i * SHMT_SLOT_NBYTES))->nbytes,
                                            __ATOMIC_RELAXED);
        }
    }
    out[0] = held;
    out[1] = freed;
    out[2] = freed_nbytes;
    return SHMT_OK;
}

/* ---------------------------------------------------------------------------------------------
 * A producer's grant (see the header). After the header, five arrays: the free extents sorted by
 * offset (ext_off/ext_len), the same sorted by (size, offset) (sz_len/sz_off: best fit is the
 * first that fits), each slot's live object (live_off/live_len, len 0: none) and the ring of free
 * slots. Finding is a bisection; inserting or removing moves an array's tail, as the Python
 * allocator's lists do.
 * ------------------------------------------------------------------------------------------- */
#define SHMT_CACHE_LINE 64u
#define SHMT_PAGE 4096u

typedef struct {
    uint64_t *ext_off, *ext_len, *sz_len, *sz_off, *live_off, *live_len;
    uint32_t *ring;
} shmt_grant_arrays;

static shmt_grant_arrays shmt_grant_arrays_of(shmt_grant_space *g)
{
    shmt_grant_arrays a;
    uint64_t *words = (uint64_t *)(g + 1);
    a.ext_off = words;
    a.ext_len = a.ext_off + g->cap;
    a.sz_len = a.ext_len + g->cap;
    a.sz_off = a.sz_len + g->cap;
    a.live_off = a.sz_off + g->cap;
    a.live_len = a.live_off + g->nslots;
    a.ring = (uint32_t *)(a.live_len + g->nslots);
    return a;
}

uint64_t shmt_grant_space_nbytes(uint32_t nslots)
{
    uint64_t cap = (uint64_t)nslots + 2;
    return sizeof(shmt_grant_space) + cap * 4 * sizeof(uint64_t) + (uint64_t)nslots * (2 * sizeof(uint64_t) +
                                                                                     sizeof(uint32_t));
}

static uint64_t shmt_round_up(uint64_t value, uint64_t align) { return (value + align - 1) / align * align; }

/* First index of (len, off) pairs >= (len, off). */
static uint32_t shmt_sz_lower(const shmt_grant_space *g, const shmt_grant_arrays *a, uint64_t len, uint64_t off)
{
    uint32_t lo = 0, hi = g->nfree;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (a->sz_len[mid] < len || (a->sz_len[mid] == len && a->sz_off[mid] < off)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* First index of free extents with offset >= off. */
static uint32_t shmt_ext_lower(const shmt_grant_space *g, const shmt_grant_arrays *a, uint64_t off)
{
    uint32_t lo = 0, hi = g->nfree;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (a->ext_off[mid] < off) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void shmt_grant_add_free(shmt_grant_space *g, shmt_grant_arrays *a, uint64_t off, uint64_t len)
{
    uint32_t n = g->nfree, i = shmt_ext_lower(g, a, off), j = shmt_sz_lower(g, a, len, off);
    memmove(a->ext_off + i + 1, a->ext_off + i, (n - i) * sizeof(uint64_t));
    memmove(a->ext_len + i + 1, a->ext_len + i, (n - i) * sizeof(uint64_t));
    a->ext_off[i] = off;
    a->ext_len[i] = len;
    memmove(a->sz_len + j + 1, a->sz_len + j, (n - j) * sizeof(uint64_t));
    memmove(a->sz_off + j + 1, a->sz_off + j, (n - j) * sizeof(uint64_t));
    a->sz_len[j] = len;
    a->sz_off[j] = off;
    g->nfree = n + 1;
}

/* Remove the free extent at ext index i. */
static void shmt_grant_remove_free(shmt_grant_space *g, shmt_grant_arrays *a, uint32_t i)
{
    uint32_t n = g->nfree, j = shmt_sz_lower(g, a, a->ext_len[i], a->ext_off[i]);
    memmove(a->ext_off + i, a->ext_off + i + 1, (n - i - 1) * sizeof(uint64_t));
    memmove(a->ext_len + i, a->ext_len + i + 1, (n - i - 1) * sizeof(uint64_t));
    memmove(a->sz_len + j, a->sz_len + j + 1, (n - j - 1) * sizeof(uint64_t));
    memmove(a->sz_off + j, a->sz_off + j + 1, (n - j - 1) * sizeof(uint64_t));
    g->nfree = n - 1;
}

static void shmt_grant_note_largest(shmt_grant_space *g, const shmt_grant_arrays *a)
{
    g->largest = g->nfree ? a->sz_len[g->nfree - 1] : 0;
}

int32_t shmt_grant_space_init(shmt_grant_space *g, uint64_t base, uint64_t nbytes, uint32_t first_slot,
                              uint32_t nslots, uint64_t page_align_min)
{
    if (!g || nbytes == 0 || nbytes % SHMT_PAGE || nslots == 0) return SHMT_EINVAL;
    memset(g, 0, sizeof(*g));
    g->base = base;
    g->nbytes = nbytes;
    g->page_align_min = page_align_min;
    g->first_slot = first_slot;
    g->nslots = nslots;
    g->free_slots = nslots;
    g->cap = nslots + 2;
    shmt_grant_arrays a = shmt_grant_arrays_of(g);
    memset(a.live_len, 0, nslots * sizeof(uint64_t));
    for (uint32_t i = 0; i < nslots; i++) a.ring[i] = i;
    shmt_grant_add_free(g, &a, 0, nbytes);
    shmt_grant_note_largest(g, &a);
    return SHMT_OK;
}

int32_t shmt_grant_place(shmt_grant_space *g, uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t nbytes,
                         uint32_t bit, uint64_t *out)
{
    if (!g || !out || nbytes == 0) return SHMT_EINVAL;
    uint64_t size = shmt_round_up(nbytes, SHMT_CACHE_LINE);
    if (!g->free_slots || size > g->largest) return SHMT_GRANT_NO_ROOM;
    uint64_t align = nbytes >= g->page_align_min ? SHMT_PAGE : SHMT_CACHE_LINE;
    shmt_grant_arrays a = shmt_grant_arrays_of(g);
    for (uint32_t j = shmt_sz_lower(g, &a, size, 0); j < g->nfree; j++) {
        uint64_t ext_off = a.sz_off[j], ext_len = a.sz_len[j];
        uint64_t start = shmt_round_up(ext_off, align);
        if (start + size > ext_off + ext_len) continue; /* alignment padding did not fit: a larger one */
        if (g->nfree + 1 > g->cap) return SHMT_GRANT_NO_ROOM; /* cannot happen: see cap */
        uint32_t rel = a.ring[g->slot_head];
        uint64_t generation = 0;
        out[2] = (uint64_t)g->first_slot + rel;
        int32_t rc = shmt_slot_publish(table, holds, nslots, out[2], g->base + start, nbytes, bit, &generation);
        if (rc != SHMT_SLOT_OK) return rc;
        g->slot_head = (g->slot_head + 1) % g->nslots;
        g->free_slots--;
        shmt_grant_remove_free(g, &a, shmt_ext_lower(g, &a, ext_off));
        if (start > ext_off) shmt_grant_add_free(g, &a, ext_off, start - ext_off);
        uint64_t tail = ext_off + ext_len - (start + size);
        if (tail) shmt_grant_add_free(g, &a, start + size, tail);
        shmt_grant_note_largest(g, &a);
        a.live_off[rel] = start;
        a.live_len[rel] = size;
        g->used += size;
        out[0] = g->base + start;
        out[1] = generation;
        return SHMT_OK;
    }
    return SHMT_GRANT_NO_ROOM;
}

int32_t shmt_grant_reclaim(shmt_grant_space *g, uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index)
{
    if (!g || index < g->first_slot || index - g->first_slot >= g->nslots) return SHMT_GRANT_NOT_LIVE;
    uint32_t rel = (uint32_t)(index - g->first_slot);
    shmt_grant_arrays a = shmt_grant_arrays_of(g);
    uint64_t start = a.live_off[rel], len = a.live_len[rel];
    if (len == 0) return SHMT_GRANT_NOT_LIVE;
    int32_t rc = shmt_slot_retire(table, holds, nslots, index);
    if (rc != SHMT_SLOT_OK) return rc; /* still held: its bytes are not ours yet */
    a.live_len[rel] = 0;
    g->used -= len;
    uint64_t end = start + len;
    uint32_t i = shmt_ext_lower(g, &a, start);
    if (i < g->nfree && a.ext_off[i] == end) { /* the next extent: merge */
        end += a.ext_len[i];
        shmt_grant_remove_free(g, &a, i);
    }
    if (i > 0 && a.ext_off[i - 1] + a.ext_len[i - 1] == start) { /* the previous one */
        start = a.ext_off[i - 1];
        shmt_grant_remove_free(g, &a, i - 1);
    }
    shmt_grant_add_free(g, &a, start, end - start);
    shmt_grant_note_largest(g, &a);
    a.ring[(g->slot_head + g->free_slots) % g->nslots] = rel;
    g->free_slots++;
    return SHMT_OK;
}

int32_t shmt_grant_release(shmt_grant_space *g, uint8_t *table, uint8_t *holds, uint64_t nslots, uint64_t index,
                           uint64_t generation, uint32_t bit, int32_t cancel_handoff, uint64_t *remaining)
{
    int32_t rc = shmt_slot_release(table, holds, nslots, index, generation, bit, cancel_handoff, remaining);
    if (rc != SHMT_SLOT_OK || *remaining) return rc;
    rc = shmt_grant_reclaim(g, table, holds, nslots, index);
    if (rc == SHMT_SLOT_ALREADY) { /* released, but not yet ours to reuse */
        *remaining = SHMT_NOT_RECLAIMED;
        return SHMT_SLOT_OK;
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * The handle on the wire (see the header): protobuf's encoding of TensorHandle, a subset read.
 * ------------------------------------------------------------------------------------------- */
enum { SHMT_WT_VARINT = 0, SHMT_WT_LEN = 2 };

/* A varint at *pos (advanced past it); 0 when truncated, longer than 10 bytes, past 64 bits or
 * not in its shortest form (which protobuf writes). */
static int shmt_varint(const uint8_t *buf, uint64_t end, uint64_t *pos, uint64_t *value)
{
    uint64_t v = 0;
    for (int i = 0; i < 10; i++) {
        if (*pos >= end) return 0;
        uint8_t b = buf[(*pos)++];
        if ((i == 9 && b > 1) || (i > 0 && b == 0)) return 0;
        v |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            *value = v;
            return 1;
        }
    }
    return 0;
}

/* A length-delimited field's [at, at + len) at *pos (advanced past it); never empty (protobuf
 * writes no empty string, bytes or packed field). */
static int shmt_span(const uint8_t *buf, uint64_t end, uint64_t *pos, uint64_t *at, uint64_t *len)
{
    uint64_t n;
    if (!shmt_varint(buf, end, pos, &n) || n == 0 || n > end - *pos) return 0;
    *at = *pos;
    *len = n;
    *pos += n;
    return 1;
}

static int shmt_ascii(const uint8_t *buf, uint64_t at, uint64_t len)
{
    for (uint64_t i = 0; i < len; i++)
        if (buf[at + i] & 0x80) return 0;
    return 1;
}

/* One field of a message at *pos: its number and wire type; 0 at a tag protobuf would not take. */
static int shmt_tag(const uint8_t *buf, uint64_t end, uint64_t *pos, uint64_t *field, uint64_t *wire_type)
{
    uint64_t tag;
    if (!shmt_varint(buf, end, pos, &tag) || tag >> 32) return 0;
    *field = tag >> 3;
    *wire_type = tag & 7;
    return *field != 0;
}

/* The nested Handle in buf[pos, end). */
static int shmt_wire_parse_shm(const uint8_t *buf, uint64_t pos, uint64_t end, shmt_wire_handle *out)
{
    uint64_t last = 0;
    while (pos < end) {
        uint64_t field, wt;
        if (!shmt_tag(buf, end, &pos, &field, &wt)) return 0;
        if (field <= last || (field > 4 && field < 16) || field > 18) return 0; /* out of order, or unknown */
        last = field;
        int is_string = field == 1 || field == 4 || field == 17;
        if (wt != (uint64_t)(is_string ? SHMT_WT_LEN : SHMT_WT_VARINT)) return 0;
        if (is_string) {
            uint64_t at, len;
            if (!shmt_span(buf, end, &pos, &at, &len) || !shmt_ascii(buf, at, len)) return 0;
            if (field == 1) out->name_at = at, out->name_len = len;
            else if (field == 4) out->owner_at = at, out->owner_len = len;
            else out->instance_at = at, out->instance_len = len;
            continue;
        }
        uint64_t v;
        if (!shmt_varint(buf, end, &pos, &v) || v == 0) return 0; /* protobuf writes no zero */
        if (field == 2) out->offset = v;
        else if (field == 3) out->nbytes = v;
        else if (field == 16) out->generation = v;
        else if (v >> 32) return 0; /* slot is a uint32: protobuf would truncate it */
        else out->slot = v;
    }
    return 1;
}

/* Packed dims in buf[pos, end). */
static int shmt_wire_parse_shape(const uint8_t *buf, uint64_t pos, uint64_t end, shmt_wire_handle *out)
{
    while (pos < end) {
        uint64_t d;
        if (out->ndim == SHMT_WIRE_MAX_DIMS || !shmt_varint(buf, end, &pos, &d)) return 0;
        out->shape[out->ndim++] = d;
    }
    return 1;
}

int32_t shmt_wire_parse(const uint8_t *buf, uint64_t nbytes, shmt_wire_handle *out)
{
    if ((!buf && nbytes) || !out) return SHMT_EINVAL;
    memset(out, 0, sizeof *out);
    uint64_t last = 0, pos = 0;
    while (pos < nbytes) {
        uint64_t field, wt, at = 0, len = 0;
        if (!shmt_tag(buf, nbytes, &pos, &field, &wt) || field <= last || field > 5 || wt != SHMT_WT_LEN)
            return SHMT_WIRE_OTHER;
        last = field;
        if (field == 1) { /* shm: written even when empty */
            if (!shmt_varint(buf, nbytes, &pos, &len) || len > nbytes - pos) return SHMT_WIRE_OTHER;
            at = pos;
            pos += len;
        } else if (!shmt_span(buf, nbytes, &pos, &at, &len)) {
            return SHMT_WIRE_OTHER;
        }
        int ok = 1;
        switch (field) {
        case 1: ok = shmt_wire_parse_shm(buf, at, at + len, out); break;
        case 2: ok = shmt_ascii(buf, at, len); out->dtype_at = at, out->dtype_len = len; break;
        case 3: ok = shmt_wire_parse_shape(buf, at, at + len, out); break;
        case 4: out->digest_at = at, out->digest_len = len; break;
        case 5: out->token_at = at, out->token_len = len; break;
        }
        if (!ok) return SHMT_WIRE_OTHER;
    }
    return SHMT_OK;
}

/* Writers: each returns the position after what it wrote, or 0 past `cap` (never a valid end:
 * every message written is at least the shm field's two bytes). */
static uint64_t shmt_put_varint(uint8_t *out, uint64_t cap, uint64_t pos, uint64_t v)
{
    do {
        if (pos >= cap) return 0;
        out[pos++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return pos;
}

static uint64_t shmt_varint_len(uint64_t v)
{
    uint64_t n = 1;
    while (v > 0x7f) v >>= 7, n++;
    return n;
}

static uint64_t shmt_put_uint(uint8_t *out, uint64_t cap, uint64_t pos, uint64_t field, uint64_t v)
{
    if (!pos || !v) return pos; /* proto3: a zero is not written */
    pos = shmt_put_varint(out, cap, pos, field << 3 | SHMT_WT_VARINT);
    return pos ? shmt_put_varint(out, cap, pos, v) : 0;
}

static uint64_t shmt_put_bytes(uint8_t *out, uint64_t cap, uint64_t pos, uint64_t field, const uint8_t *v,
                               uint64_t len)
{
    if (!pos || !len) return pos; /* proto3: an empty string is not written */
    pos = shmt_put_varint(out, cap, pos, field << 3 | SHMT_WT_LEN);
    if (pos) pos = shmt_put_varint(out, cap, pos, len);
    if (!pos || len > cap - pos) return 0;
    memcpy(out + pos, v, len);
    return pos + len;
}

static uint64_t shmt_len_field(uint64_t field, uint64_t len)
{
    return len ? shmt_varint_len(field << 3) + shmt_varint_len(len) + len : 0;
}

static uint64_t shmt_uint_field(uint64_t field, uint64_t v)
{
    return v ? shmt_varint_len(field << 3) + shmt_varint_len(v) : 0;
}

int64_t shmt_wire_write(uint8_t *out, uint64_t cap, const uint8_t *name, uint64_t name_len, uint64_t offset,
                        uint64_t nbytes, const uint8_t *owner, uint64_t owner_len, uint64_t generation,
                        const uint8_t *instance, uint64_t instance_len, uint64_t slot, const uint8_t *dtype,
                        uint64_t dtype_len, const uint8_t *shape, uint64_t ndim, const uint8_t *digest,
                        uint64_t digest_len, const uint8_t *token, uint64_t token_len)
{
    if (!out || (ndim && !shape) || slot >> 32) return SHMT_EINVAL;
    uint64_t shm_len = shmt_len_field(1, name_len) + shmt_uint_field(2, offset) + shmt_uint_field(3, nbytes) +
                       shmt_len_field(4, owner_len) + shmt_uint_field(16, generation) +
                       shmt_len_field(17, instance_len) + shmt_uint_field(18, slot);
    uint64_t shape_len = 0, dim;
    for (uint64_t i = 0; i < ndim; i++) {
        memcpy(&dim, shape + 8 * i, 8); /* little-endian, as the build requires */
        shape_len += shmt_varint_len(dim);
    }
    uint64_t pos = shmt_put_varint(out, cap, 0, 1 << 3 | SHMT_WT_LEN); /* shm: always present */
    if (pos) pos = shmt_put_varint(out, cap, pos, shm_len);
    pos = shmt_put_bytes(out, cap, pos, 1, name, name_len);
    pos = shmt_put_uint(out, cap, pos, 2, offset);
    pos = shmt_put_uint(out, cap, pos, 3, nbytes);
    pos = shmt_put_bytes(out, cap, pos, 4, owner, owner_len);
    pos = shmt_put_uint(out, cap, pos, 16, generation);
    pos = shmt_put_bytes(out, cap, pos, 17, instance, instance_len);
    pos = shmt_put_uint(out, cap, pos, 18, slot);
    pos = shmt_put_bytes(out, cap, pos, 2, dtype, dtype_len);
    if (pos && shape_len) {
        pos = shmt_put_varint(out, cap, pos, 3 << 3 | SHMT_WT_LEN);
        if (pos) pos = shmt_put_varint(out, cap, pos, shape_len);
        for (uint64_t i = 0; pos && i < ndim; i++) {
            memcpy(&dim, shape + 8 * i, 8);
            pos = shmt_put_varint(out, cap, pos, dim);
        }
    }
    pos = shmt_put_bytes(out, cap, pos, 4, digest, digest_len);
    pos = shmt_put_bytes(out, cap, pos, 5, token, token_len);
    return pos ? (int64_t)pos : SHMT_EINVAL;
}

static const struct {
    const char *name;
    uint64_t itemsize;
} shmt_dtypes[] = {
    {"bool", 1},    {"uint8", 1},   {"int8", 1},    {"float16", 2},  {"bfloat16", 2},
    {"uint16", 2},  {"int16", 2},   {"float32", 4}, {"uint32", 4},   {"int32", 4},
    {"float64", 8}, {"uint64", 8},  {"int64", 8},
};

uint64_t shmt_dtype_itemsize(const uint8_t *name, uint64_t len)
{
    for (size_t i = 0; name && i < sizeof shmt_dtypes / sizeof shmt_dtypes[0]; i++)
        if (strlen(shmt_dtypes[i].name) == len && !memcmp(shmt_dtypes[i].name, name, len))
            return shmt_dtypes[i].itemsize;
    return 0;
}

/* Whether the handle's dtype and shape make its size, as tensor_nbytes counts (exactly, with
 * the product of the nonzero dims times the item size within int64). */
static int shmt_wire_manifest_ok(const uint8_t *buf, const shmt_wire_handle *h)
{
    uint64_t itemsize = shmt_dtype_itemsize(buf + h->dtype_at, h->dtype_len);
    uint64_t nonzero = itemsize, total = itemsize;
    if (!itemsize) return 0;
    for (uint64_t i = 0; i < h->ndim; i++) {
        if (h->shape[i] && __builtin_mul_overflow(nonzero, h->shape[i], &nonzero)) return 0;
        total *= h->shape[i]; /* <= nonzero, so it cannot wrap once nonzero did not */
    }
    if (nonzero > (uint64_t)INT64_MAX) return 0;
    return total == h->nbytes || (total == 0 && h->nbytes == 1);
}

int32_t shmt_wire_acquire(const uint8_t *buf, uint64_t nbytes, const uint8_t *name, uint64_t name_len,
                          const uint8_t *instance, uint64_t instance_len, uint64_t arena_nbytes, uint8_t *table,
                          uint8_t *holds, uint64_t nslots, uint32_t bit, shmt_wire_handle *out)
{
    if (!name || !instance) return SHMT_EINVAL;
    int32_t rc = shmt_wire_parse(buf, nbytes, out);
    if (rc != SHMT_OK) return rc;
    if (!out->slot || out->token_len || out->name_len != name_len || out->instance_len != instance_len ||
        memcmp(buf + out->name_at, name, name_len) || memcmp(buf + out->instance_at, instance, instance_len) ||
        out->offset > arena_nbytes || out->nbytes > arena_nbytes - out->offset || !shmt_wire_manifest_ok(buf, out))
        return SHMT_WIRE_OTHER;
    return shmt_slot_acquire(table, holds, nslots, out->slot - 1, out->generation, out->offset, out->nbytes, bit);
}

/* ---------------------------------------------------------------------------------------------
 * A client's fast lane (see the header).
 * ------------------------------------------------------------------------------------------- */
struct shmt_lane {
    uint8_t *table;
    uint8_t *holds;
    uint64_t nslots;
    uint64_t arena_nbytes;
    uint32_t bit;
    uint32_t lock;   /* guards leases and the counts below */
    uint64_t leases; /* counted now */
    uint64_t name_len, owner_len, instance_len;
    uint8_t name[SHMT_LANE_ID_MAX], owner[SHMT_LANE_ID_MAX], instance[SHMT_LANE_ID_MAX];
    /* then, per slot: the generation counted, and how many leases on it (0: none) */
};

static uint64_t *shmt_lane_gens(shmt_lane *lane) { return (uint64_t *)(lane + 1); }
static uint32_t *shmt_lane_counts(shmt_lane *lane) { return (uint32_t *)(shmt_lane_gens(lane) + lane->nslots); }

uint64_t shmt_lane_nbytes(uint64_t nslots) { return sizeof(shmt_lane) + nslots * (sizeof(uint64_t) + sizeof(uint32_t)); }

int32_t shmt_lane_init(shmt_lane *lane, uint8_t *table, uint8_t *holds, uint64_t nslots, uint32_t bit,
                       const uint8_t *name, uint64_t name_len, const uint8_t *owner, uint64_t owner_len,
                       const uint8_t *instance, uint64_t instance_len, uint64_t arena_nbytes)
{
    if (!lane || !shmt_aligned(table) || !shmt_aligned(holds) || name_len > SHMT_LANE_ID_MAX ||
        owner_len > SHMT_LANE_ID_MAX || instance_len > SHMT_LANE_ID_MAX || bit > SHMT_HOLDER_PROXY ||
        (name_len && !name) || (owner_len && !owner) || (instance_len && !instance))
        return SHMT_EINVAL;
    lane->table = table;
    lane->holds = holds;
    lane->nslots = nslots;
    lane->arena_nbytes = arena_nbytes;
    lane->bit = bit;
    lane->name_len = name_len;
    lane->owner_len = owner_len;
    lane->instance_len = instance_len;
    if (name_len) memcpy(lane->name, name, name_len);
    if (owner_len) memcpy(lane->owner, owner, owner_len);
    if (instance_len) memcpy(lane->instance, instance, instance_len);
    return SHMT_OK;
}

int32_t shmt_lane_place(shmt_lane *lane, shmt_grant_space *g, uint64_t nbytes, const uint8_t *dtype,
                        uint64_t dtype_len, const uint8_t *shape, uint64_t ndim, uint64_t *out, uint8_t *wire,
                        uint64_t cap)
{
    if (!lane || !out) return SHMT_EINVAL;
    int32_t rc = shmt_grant_place(g, lane->table, lane->holds, lane->nslots, nbytes, lane->bit, out);
    if (rc != SHMT_OK) return rc;
    out[3] = 0;
    if (!wire) return SHMT_OK;
    int64_t n = shmt_wire_write(wire, cap, lane->name, lane->name_len, out[0], nbytes, lane->owner,
                                lane->owner_len, out[1], lane->instance, lane->instance_len, out[2] + 1, dtype,
                                dtype_len, shape, ndim, NULL, 0, NULL, 0);
    if (n < 0) { /* the object goes back: it was never anyone's but ours */
        uint64_t remaining;
        shmt_grant_release(g, lane->table, lane->holds, lane->nslots, out[2], out[1], lane->bit, 1, &remaining);
        return SHMT_EINVAL;
    }
    out[3] = (uint64_t)n;
    return SHMT_OK;
}

int32_t shmt_lane_commit(shmt_lane *lane, uint64_t index, uint64_t generation, uint64_t deadline_ns, int32_t hold)
{
    if (!lane) return SHMT_EINVAL;
    return shmt_slot_commit(lane->table, lane->holds, lane->nslots, index, generation, lane->bit, deadline_ns, hold);
}

int32_t shmt_lane_release_own(shmt_lane *lane, shmt_grant_space *g, uint64_t index, uint64_t generation,
                              int32_t cancel_handoff, uint64_t *remaining)
{
    if (!lane) return SHMT_EINVAL;
    return shmt_grant_release(g, lane->table, lane->holds, lane->nslots, index, generation, lane->bit,
                              cancel_handoff, remaining);
}

static void shmt_lane_lock(shmt_lane *lane)
{
    while (__atomic_exchange_n(&lane->lock, 1, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(&lane->lock, __ATOMIC_RELAXED)) {
#if SHMT_X86
            _mm_pause();
#endif
        }
    }
}

static void shmt_lane_unlock(shmt_lane *lane) { __atomic_store_n(&lane->lock, 0, __ATOMIC_RELEASE); }

/* Count the lease an acquire of `status` took (lock held): SHMT_SLOT_OK when it holds one now. */
static int32_t shmt_lane_count_in(shmt_lane *lane, uint64_t index, uint64_t generation, int32_t status)
{
    if (index >= lane->nslots) return status;
    uint64_t *gen = &shmt_lane_gens(lane)[index];
    uint32_t *count = &shmt_lane_counts(lane)[index];
    if (status == SHMT_SLOT_OK) { /* the bit was not set: any count left is of a hold cleared since */
        lane->leases += 1 - (uint64_t)*count;
        *count = 1;
        *gen = generation;
        return SHMT_SLOT_OK;
    }
    if (status == SHMT_SLOT_ALREADY && *count && *gen == generation && *count < UINT32_MAX) {
        (*count)++;
        lane->leases++;
        return SHMT_SLOT_OK;
    }
    return status;
}

int32_t shmt_lease_acquire_wire(shmt_lane *lane, const uint8_t *buf, uint64_t nbytes, uint64_t *out)
{
    if (!lane || !out) return SHMT_EINVAL;
    shmt_wire_handle h;
    shmt_lane_lock(lane);
    int32_t rc = shmt_wire_acquire(buf, nbytes, lane->name, lane->name_len, lane->instance, lane->instance_len,
                                   lane->arena_nbytes, lane->table, lane->holds, lane->nslots, lane->bit, &h);
    if (rc >= 0) rc = shmt_lane_count_in(lane, h.slot - 1, h.generation, rc);
    shmt_lane_unlock(lane);
    if (rc < 0) return rc;
    if (rc == SHMT_SLOT_NOT_COMMITTED &&
        __atomic_load_n(&shmt_slot_at(lane->table, lane->nslots, h.slot - 1)->owner, __ATOMIC_RELAXED) ==
            SHMT_HOLDER_PROXY)
        return SHMT_WIRE_OTHER; /* a loan the daemon placed, its Commit maybe in flight: the daemon waits */
    out[0] = h.offset;
    out[1] = h.nbytes;
    out[2] = h.generation;
    out[3] = h.slot - 1;
    out[4] = h.dtype_at;
    out[5] = h.dtype_len;
    out[6] = h.digest_at;
    out[7] = h.digest_len;
    out[8] = h.ndim;
    memcpy(out + 9, h.shape, h.ndim * sizeof(uint64_t));
    return rc;
}

int32_t shmt_lease_acquire(shmt_lane *lane, uint64_t index, uint64_t generation, uint64_t offset,
                           uint64_t nbytes)
{
    if (!lane) return SHMT_EINVAL;
    shmt_lane_lock(lane);
    int32_t rc = shmt_slot_acquire(lane->table, lane->holds, lane->nslots, index, generation, offset, nbytes,
                                   lane->bit);
    if (rc >= 0) rc = shmt_lane_count_in(lane, index, generation, rc);
    shmt_lane_unlock(lane);
    return rc;
}

int32_t shmt_lease_release(shmt_lane *lane, uint64_t index, uint64_t generation)
{
    if (!lane) return SHMT_EINVAL;
    if (index >= lane->nslots) return SHMT_SLOT_NOT_HELD;
    uint32_t *count = &shmt_lane_counts(lane)[index];
    int32_t rc = SHMT_SLOT_OK;
    shmt_lane_lock(lane);
    if (!*count || shmt_lane_gens(lane)[index] != generation) {
        rc = SHMT_SLOT_NOT_HELD;
    } else {
        lane->leases--;
        if (--*count == 0) {
            uint64_t remaining;
            rc = shmt_slot_release(lane->table, lane->holds, lane->nslots, index, generation, lane->bit, 0,
                                   &remaining);
        }
    }
    shmt_lane_unlock(lane);
    return rc;
}

uint64_t shmt_lease_count(shmt_lane *lane)
{
    return lane ? __atomic_load_n(&lane->leases, __ATOMIC_RELAXED) : 0;
}

uint64_t shmt_lease_release_all(shmt_lane *lane)
{
    if (!lane) return 0;
    uint64_t cleared = 0, remaining;
    uint64_t *gens = shmt_lane_gens(lane);
    uint32_t *counts = shmt_lane_counts(lane);
    shmt_lane_lock(lane);
    for (uint64_t i = 0; i < lane->nslots && lane->leases; i++) {
        if (!counts[i]) continue;
        lane->leases -= counts[i];
        counts[i] = 0;
        /* a hold the daemon already cleared (the session ended first) is no error here */
        if (shmt_slot_release(lane->table, lane->holds, lane->nslots, i, gens[i], lane->bit, 0, &remaining) ==
            SHMT_SLOT_OK)
            cleared++;
    }
    shmt_lane_unlock(lane);
    return cleared;
}
