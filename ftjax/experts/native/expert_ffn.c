/* SwiGLU expert FFNs on the CPU, read straight from the host expert banks (ftjax.experts.cpu_native).

   Source of the idea: FreeToken's CPU executor (and Fiddler before it) computes a layer's cache misses on
   the host cores where the expert weights already are, so only the activations cross PCIe. For one token
   an expert FFN is a matrix-vector product bound by how fast the cores read its weights from DRAM, so
   every thread works on every expert: each expert's matrices are cut into blocks of contiguous input
   rows, one (expert, row block) per work unit, spread over OpenMP threads; each row is decoded to float32
   in registers (again for every token; table formats, and int4's rows left after its four-row passes: once,
   into the core's cache, when there are several tokens) and multiplied into float32 sums of all tokens; the sums
   of rows that share a scale row are then scaled. One to four tokens' int4 rows on AVX-512, or AVX2 with FMA,
   take their own loop (i4_rows: a scale group's sums in registers).

   One call computes, for the k experts ids[0..k-1] and the n tokens x [n][D] (float32):
     h = x @ gate_up[id]   [n][2F]   (gate | up),
     a = silu(h[:, :F]) * h[:, F:]   [n][F],
     y[j] = a @ down[id]   [n][D]    (float32),
   in three phases separated by barriers: gate_up row blocks -> their partial sums reduced with the SiLU
   gate -> down row blocks -> their partial sums reduced into y. Everything accumulates in float32.

   Stored formats (ftjax.experts.formats), one matrix [rows][cols] of one expert stored [rows][cols / pack]:
     FT_BF16  bfloat16 (dense), decoded by a 16-bit shift;
     FT_F32   float32 (dense), read in place;
     FT_I8    int8 with block scales, decoded by a cast;
     FT_I4    two nibbles per byte (byte j: column 2j low, 2j + 1 high), decoded as nibble - 8;
     FT_LUT8  any other one-byte format (fp8 e4m3fn), decoded by a 256-entry float32 table.
   Scales (float32 [nbi][nsc] per expert, NULL for dense): one per block of bi input rows x bo output
   columns, for each of `parts` equal parts of the columns (gate_up: gate | up), so column c of row r
   has scale s[r / bi][(c / per) * (nsc / parts) + (c % per) / bo] with per = cols / parts (the caller
   passes that column index as sidx). A weight's value is decode(q) * scale, as
   ftjax.experts.formats.ExpertFormat.dequantize computes it before its cast; the kernel sums the rows that
   share a scale row, then multiplies the sums by their scales. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define FTJAX_NATIVE_ABI 1

enum { FT_BF16 = 0, FT_F32 = 1, FT_I8 = 2, FT_I4 = 3, FT_LUT8 = 4 };

/* One bank (gate_up or down) of the host expert banks. Mirrored by ftjax.experts.cpu_native._Mat. */
typedef struct {
  const void* w;      /* bank base: [R][rows][cols / pack] stored values, C order */
  const float* s;     /* scale bank base: [R][nbi][nsc] float32, or NULL (dense) */
  const float* lut;   /* FT_LUT8: the float32 value of each stored byte; else NULL */
  const int32_t* sidx;/* [cols]: the scale column of each column (FT_I4: in the decoded order), or NULL when
                         it is the column itself (one scale per column, bo = 1) */
  int64_t w_stride;   /* bytes from one expert's weights to the next */
  int64_t s_stride;   /* floats from one expert's scales to the next */
  int32_t kind, rows, cols, bi, bo, parts, nsc;
} ftjax_mat;

int ftjax_native_abi(void) { return FTJAX_NATIVE_ABI; }

int ftjax_native_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

static inline float bf16(uint16_t v) { union { uint32_t u; float f; } c; c.u = (uint32_t)v << 16; return c.f; }

/* The scales of scale row gi, one per column (in FT_I4's decoded order): the row itself when sidx is NULL,
   else gathered into srow. */
static const float* scales_row(const ftjax_mat* m, const float* s, int gi, float* restrict srow) {
  const float* restrict sr = s + (size_t)gi * m->nsc;
  if (!m->sidx) return sr;
  for (int c = 0; c < m->cols; c++) srow[c] = sr[m->sidx[c]];
  return srow;
}

/* One stored row's values (unscaled) into the token sums. Cheap decodes (bf16, float32, int8) are redone for
   every token in registers: dst[t][OFF + c] += x[t] * EXPR for c < LEN. */
#define FUSED(LEN, OFF, EXPR)                                                               \
  for (int t = 0; t < n; t++) {                                                             \
    float xt = x[(size_t)t * ldx + r];                                                      \
    float* restrict d0 = dst + (size_t)t * cols + (OFF);                                    \
    for (int c = 0; c < (LEN); c++) d0[c] += xt * (EXPR);                                   \
  }
/* Costly decodes (int4 nibbles, table look-ups): one token as FUSED; more tokens: wf[OFF + c] = EXPR once,
   then multiplied into every token's sums (staged = 1). */
#define STAGED(LEN, OFF, EXPR)                                                              \
  if (n == 1) {                                                                             \
    FUSED(LEN, OFF, EXPR)                                                                   \
  } else {                                                                                  \
    float* restrict w0 = wf + (OFF);                                                        \
    for (int c = 0; c < (LEN); c++) w0[c] = (EXPR);                                         \
    staged = 1;                                                                             \
  }

/* The rows r..r+3 of one expert's stored int8 or int4 matrix into the token sums: dst[t][c] += sum over the
   four rows of x[t][row] * decode(W[row][c]), decoded in registers for every token. Summing four rows before
   the sums are loaded and stored again quarters the traffic to the sums, which bounds the one-row loop of
   the one-byte and half-byte formats (a float32 load and store per weight of one or half a byte). bf16 and
   float32 keep the one-row loop: on a 2-core AVX-512 VM (2026-12-07) four rows were no faster for them
   when read from DRAM. */
#define ROWS_PER_PASS 4
#define FOUR(TYPE, ROWLEN, BODY)                                                            \
  {                                                                                         \
    const TYPE* restrict q0 = (const TYPE*)w + (size_t)r * (ROWLEN);                        \
    const TYPE* restrict q1 = q0 + (ROWLEN);                                                \
    const TYPE* restrict q2 = q1 + (ROWLEN);                                                \
    const TYPE* restrict q3 = q2 + (ROWLEN);                                                \
    for (int t = 0; t < n; t++) {                                                           \
      const float* xr = x + (size_t)t * ldx + r;                                            \
      float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];                                 \
      float* restrict d0 = dst + (size_t)t * cols;                                          \
      BODY                                                                                  \
    }                                                                                       \
  }
#define DOT4(DEC, C) (x0 * DEC(q0[C]) + x1 * DEC(q1[C]) + x2 * DEC(q2[C]) + x3 * DEC(q3[C]))
#define DEC_SAME(v) (float)(v)
#define DEC_LO(v) (float)((int)((v) & 15) - 8)
#define DEC_HI(v) (float)((int)((v) >> 4) - 8)

static void accum_four_rows(const ftjax_mat* m, const void* w, int r, const float* x, int ldx, int n,
                            float* restrict dst) {
  int cols = m->cols, half = cols / 2;
  switch (m->kind) {
    case FT_I8: FOUR(int8_t, cols, for (int c = 0; c < cols; c++) d0[c] += DOT4(DEC_SAME, c);) break;
    case FT_I4:   /* low nibbles -> the first half of the decoded order, high -> the second */
      FOUR(uint8_t, half, {
        float* restrict h0 = d0 + half;
        for (int j = 0; j < half; j++) {
          d0[j] += DOT4(DEC_LO, j);
          h0[j] += DOT4(DEC_HI, j);
        }
      }) break;
    default: break;
  }
}

/* dst [n][cols] += x[:, r0:r1] @ decode(W[r0:r1, :]) (unscaled), w: one expert's stored matrix, x [n][ldx];
   FT_I4 sums in the decoded column order (even columns, then odd). wf [cols]: scratch. */
static void accum_rows(const ftjax_mat* m, const void* w, int r0, int r1, const float* x, int ldx, int n,
                       float* restrict dst, float* restrict wf) {
  int cols = m->cols, half = cols / 2;
  int r = r0;
  if (m->kind == FT_I8 || m->kind == FT_I4)   /* four rows a pass (accum_four_rows) */
    for (; r + ROWS_PER_PASS <= r1; r += ROWS_PER_PASS) accum_four_rows(m, w, r, x, ldx, n, dst);
  for (; r < r1; r++) {
    int staged = 0;
    switch (m->kind) {
      case FT_BF16: { const uint16_t* restrict q = (const uint16_t*)w + (size_t)r * cols; FUSED(cols, 0, bf16(q[c])) break; }
      case FT_F32: { const float* restrict q = (const float*)w + (size_t)r * cols; FUSED(cols, 0, q[c]) break; }
      case FT_I8: { const int8_t* restrict q = (const int8_t*)w + (size_t)r * cols; FUSED(cols, 0, (float)q[c]) break; }
      case FT_I4: {   /* both nibbles of a byte in one pass: low -> column j, high -> column half + j */
        const uint8_t* restrict q = (const uint8_t*)w + (size_t)r * half;
        float* restrict lo = wf;
        float* restrict hi = wf + half;
        float xt = x[r];
        if (n == 1) { lo = dst; hi = dst + half; }
        else staged = 1;
        if (n == 1)
          for (int j = 0; j < half; j++) {
            lo[j] += xt * (float)((int)(q[j] & 15) - 8);
            hi[j] += xt * (float)((int)(q[j] >> 4) - 8);
          }
        else
          for (int j = 0; j < half; j++) {
            lo[j] = (float)((int)(q[j] & 15) - 8);
            hi[j] = (float)((int)(q[j] >> 4) - 8);
          }
        break;
      }
      default: {
        const uint8_t* restrict q = (const uint8_t*)w + (size_t)r * cols;
        const float* restrict lut = m->lut;
        STAGED(cols, 0, lut[q[c]])
      }
    }
    if (!staged) continue;
    for (int t = 0; t < n; t++) {
      float xr = x[(size_t)t * ldx + r];
      float* restrict dt = dst + (size_t)t * cols;
      for (int c = 0; c < cols; c++) dt[c] += xr * wf[c];
    }
  }
}

/* A few tokens' int4 rows in vector registers (AVX-512, or AVX2 with FMA), scale group by scale group: blk [nt][cols]
   (decoded order: the low nibbles' columns, then the high ones') += x[:, r0:r1] @ (decode(W[r0:r1, :]) * scales),
   x [nt][ldx]. A group's sums stay in registers for a chunk of `ch` stored bytes (2 x ch columns, each token's)
   while its rows stream past, so a chunk's sums are loaded and stored once a group instead of once every four rows
   (accum_four_rows), and each row is decoded once for all the tokens. On AVX-512 a nibble becomes nibble - 8 in one
   permute of a 16-entry float table (vpermps reads an index's low four bits) instead of a mask, a convert and a
   subtract (AVX2's permute takes 8 entries: it masks, converts and subtracts). Same sums as accum_four_rows' in
   another order. nt and ch are constants at each call (i4_few_tokens), so the loops over them unroll and the sums
   live in registers: 2 x nt x ch / I4_LANES of them. FTJAX_NO_AVX512 (tests) builds the AVX2 form on an AVX-512
   CPU. */
#if defined(__AVX512F__) && !defined(FTJAX_NO_AVX512)
#include <immintrin.h>
#define I4_FEW_TOKENS 4
#define I4_LANES 16
#define I4_CHUNK_1 64   /* stored bytes per chunk for 1, 2, 3 and 4 tokens (i4_few_tokens) */
#define I4_CHUNK_2 64
#define I4_CHUNK_3 64
#define I4_CHUNK_4 32
typedef __m512 i4_vf;
typedef __m512i i4_vi;
#define I4_ZERO() _mm512_setzero_ps()
#define I4_SET1(v) _mm512_set1_ps(v)
#define I4_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define I4_LOADF(p) _mm512_loadu_ps(p)
#define I4_STOREF(p, v) _mm512_storeu_ps(p, v)
#define I4_BYTES(q) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q)))   /* 16 bytes -> 16 int32 */
#define I4_GATHER(idx, base) _mm512_i32gather_ps(_mm512_loadu_si512(idx), base, 4)
#define I4_TABLE const __m512 table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
#define I4_LO(b) _mm512_permutexvar_ps(b, table)
#define I4_HI(b) _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define I4_FEW_TOKENS 4
#define I4_LANES 8
#define I4_CHUNK_1 32
#define I4_CHUNK_2 16
#define I4_CHUNK_3 8
#define I4_CHUNK_4 8
typedef __m256 i4_vf;
typedef __m256i i4_vi;
#define I4_ZERO() _mm256_setzero_ps()
#define I4_SET1(v) _mm256_set1_ps(v)
#define I4_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define I4_LOADF(p) _mm256_loadu_ps(p)
#define I4_STOREF(p, v) _mm256_storeu_ps(p, v)
#define I4_BYTES(q) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q)))   /* 8 bytes -> 8 int32 */
#define I4_GATHER(idx, base) _mm256_i32gather_ps(base, _mm256_loadu_si256((const __m256i*)(idx)), 4)
#define I4_TABLE const __m256i mask = _mm256_set1_epi32(15); const __m256 eight = _mm256_set1_ps(8.0f)
#define I4_LO(b) _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, mask)), eight)
#define I4_HI(b) _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), eight)
#endif

#ifdef I4_FEW_TOKENS
static inline __attribute__((always_inline)) void i4_rows(const ftjax_mat* m, const uint8_t* w, const float* s,
                                                          int r0, int r1, const float* x, int ldx,
                                                          float* restrict blk, float* restrict srow, const int nt,
                                                          const int ch) {
  enum { V = I4_LANES };
  int cols = m->cols, half = cols / 2, full = half - half % ch;
  size_t ahead = (size_t)m->bi * half;   /* the same bytes of the next scale group, read a group ahead */
  I4_TABLE;
  for (int g0 = r0, g1; g0 < r1; g0 = g1) {
    int gi = g0 / m->bi;
    g1 = (gi + 1) * m->bi < r1 ? (gi + 1) * m->bi : r1;
    const float* restrict sr = s + (size_t)gi * m->nsc;   /* this group's scale row */
    size_t pf = g1 < r1 ? ahead : 0;   /* the last group of a block: the next rows are another unit's */
    for (int j0 = 0; j0 < full; j0 += ch) {
      i4_vf lo[I4_FEW_TOKENS][4], hi[I4_FEW_TOKENS][4];
      for (int t = 0; t < nt; t++)
        for (int v = 0; v < ch / V; v++) lo[t][v] = hi[t][v] = I4_ZERO();
      for (int r = g0; r < g1; r++) {
        const uint8_t* q = w + (size_t)r * half + j0;
        _mm_prefetch((const char*)(q + pf), _MM_HINT_T0);
        i4_vf xr[I4_FEW_TOKENS];
        for (int t = 0; t < nt; t++) xr[t] = I4_SET1(x[(size_t)t * ldx + r]);
        for (int v = 0; v < ch / V; v++) {
          i4_vi b = I4_BYTES(q + V * v);
          i4_vf dl = I4_LO(b), dh = I4_HI(b);
          for (int t = 0; t < nt; t++) {
            lo[t][v] = I4_FMA(xr[t], dl, lo[t][v]);
            hi[t][v] = I4_FMA(xr[t], dh, hi[t][v]);
          }
        }
      }
      for (int v = 0; v < ch / V; v++) {   /* the scales of the decoded columns, gathered */
        int cl = j0 + V * v, chi = half + cl;
        i4_vf sl = m->sidx ? I4_GATHER(m->sidx + cl, sr) : I4_LOADF(sr + cl);
        i4_vf sh = m->sidx ? I4_GATHER(m->sidx + chi, sr) : I4_LOADF(sr + chi);
        for (int t = 0; t < nt; t++) {
          float* bt = blk + (size_t)t * cols;
          I4_STOREF(bt + cl, I4_FMA(sl, lo[t][v], I4_LOADF(bt + cl)));
          I4_STOREF(bt + chi, I4_FMA(sh, hi[t][v], I4_LOADF(bt + chi)));
        }
      }
    }
    if (full < half) {   /* the columns past the last whole chunk */
      const float* restrict sc = scales_row(m, s, gi, srow);
      for (int j = full; j < half; j++) {
        float lo[I4_FEW_TOKENS] = {0}, hi[I4_FEW_TOKENS] = {0};
        for (int r = g0; r < g1; r++) {
          uint8_t q = w[(size_t)r * half + j];
          float dl = DEC_LO(q), dh = DEC_HI(q);
          for (int t = 0; t < nt; t++) {
            lo[t] += x[(size_t)t * ldx + r] * dl;
            hi[t] += x[(size_t)t * ldx + r] * dh;
          }
        }
        for (int t = 0; t < nt; t++) {
          blk[(size_t)t * cols + j] += sc[j] * lo[t];
          blk[(size_t)t * cols + half + j] += sc[half + j] * hi[t];
        }
      }
    }
  }
}

/* i4_rows for n = 1 to I4_FEW_TOKENS tokens. AVX-512 (32 registers): chunks of 64 stored bytes (one cache line) for
   one to three tokens, 32 for four (at 64, four tokens' 32 sums would not fit). On a 2-core AVX-512 VM (2026-12-07)
   one token ran 17-18 GB/s in 64-byte chunks against 14.1-14.5 in 32-byte ones and 11.9 in 128-byte ones; three
   tokens 14.4-14.6 in 64-byte chunks against 13.3-13.6 in 32-byte ones. AVX2 (16 registers): 32 bytes for one token,
   16 for two, 8 for three or four (6 to 8 sums). */
static void i4_few_tokens(const ftjax_mat* m, const uint8_t* w, const float* s, int r0, int r1, const float* x,
                          int ldx, int n, float* restrict blk, float* restrict srow) {
  switch (n) {
    case 1: i4_rows(m, w, s, r0, r1, x, ldx, blk, srow, 1, I4_CHUNK_1); break;
    case 2: i4_rows(m, w, s, r0, r1, x, ldx, blk, srow, 2, I4_CHUNK_2); break;
    case 3: i4_rows(m, w, s, r0, r1, x, ldx, blk, srow, 3, I4_CHUNK_3); break;
    default: i4_rows(m, w, s, r0, r1, x, ldx, blk, srow, 4, I4_CHUNK_4); break;
  }
}
#endif

/* out [n][cols] = x[:, r0:r1] @ W[r0:r1, :] for one expert (w, s: its stored matrix and scales, s NULL for
   dense); x [n][ldx] float32. Rows that share a scale row are summed unscaled, then scaled per column.
   acc, tmp [n][cols], wf, srow [cols]: this thread's scratch. */
static void row_block(const ftjax_mat* m, const void* w, const float* s, int r0, int r1, const float* x, int ldx,
                      int n, float* restrict out, float* restrict acc, float* restrict tmp, float* restrict wf,
                      float* restrict srow) {
  int cols = m->cols;
  size_t nc = (size_t)n * cols;
  float* blk = m->kind == FT_I4 ? acc : out;   /* int4 sums in the decoded column order */
  memset(blk, 0, sizeof(float) * nc);
#ifdef I4_FEW_TOKENS
  if (m->kind == FT_I4 && n <= I4_FEW_TOKENS && s) {
    i4_few_tokens(m, (const uint8_t*)w, s, r0, r1, x, ldx, n, blk, srow);
  } else
#endif
  if (!s) {
    accum_rows(m, w, r0, r1, x, ldx, n, blk, wf);
  } else if (r0 / m->bi == (r1 - 1) / m->bi) {   /* one scale row (int8 always) */
    accum_rows(m, w, r0, r1, x, ldx, n, blk, wf);
    const float* restrict sc = scales_row(m, s, r0 / m->bi, srow);
    for (int t = 0; t < n; t++) {
      float* restrict bt = blk + (size_t)t * cols;
      for (int c = 0; c < cols; c++) bt[c] *= sc[c];
    }
  } else {
    for (int g0 = r0, g1; g0 < r1; g0 = g1) {
      int gi = g0 / m->bi;
      g1 = (gi + 1) * m->bi < r1 ? (gi + 1) * m->bi : r1;
      memset(tmp, 0, sizeof(float) * nc);
      accum_rows(m, w, g0, g1, x, ldx, n, tmp, wf);
      const float* restrict sc = scales_row(m, s, gi, srow);
      for (int t = 0; t < n; t++) {
        float* restrict bt = blk + (size_t)t * cols;
        const float* restrict tt = tmp + (size_t)t * cols;
        for (int c = 0; c < cols; c++) bt[c] += sc[c] * tt[c];
      }
    }
  }
  if (m->kind == FT_I4) {   /* back to the true column order */
    int half = cols / 2;
    for (int t = 0; t < n; t++) {
      const float* restrict src = acc + (size_t)t * cols;
      float* restrict dst = out + (size_t)t * cols;
      for (int j = 0; j < half; j++) { dst[2 * j] = src[j]; dst[2 * j + 1] = src[half + j]; }
    }
  }
}

static int blocks_of(int rows, int rb) { return (rows + rb - 1) / rb; }

static int wider(const ftjax_mat* gu, const ftjax_mat* dn) { return gu->cols > dn->cols ? gu->cols : dn->cols; }

/* Work buffer layout, in floats: every piece starts on a 64-byte boundary when the buffer does (misaligned
   vector stores cost a third of the time). */
static size_t pad16(size_t v) { return (v + 15) & ~(size_t)15; }

typedef struct { size_t u1, u2, p2, act, scratch, per_thread, nw; } layout;

static layout layout_of(const ftjax_mat* gu, const ftjax_mat* dn, int k, int n, int nb1, int nb2) {
  layout l;
  size_t wide = (size_t)wider(gu, dn);
  l.u1 = pad16((size_t)n * gu->cols);                 /* one gate_up partial sum [n][2F] */
  l.u2 = pad16((size_t)n * dn->cols);                 /* one down partial sum [n][D] */
  l.p2 = pad16((size_t)k * nb1 * l.u1);
  l.act = l.p2 + pad16((size_t)k * nb2 * l.u2);
  l.scratch = l.act + pad16((size_t)k * n * dn->rows);
  l.per_thread = 2 * pad16((size_t)n * wide) + 2 * pad16(wide);
  l.nw = wide;
  return l;
}

/* Floats of the work buffer ftjax_expert_ffn needs for these arguments (give it 64-byte aligned). */
int64_t ftjax_expert_ffn_work(const ftjax_mat* gu, const ftjax_mat* dn, int k, int n, int rb1, int rb2,
                              int threads) {
  layout l = layout_of(gu, dn, k, n, blocks_of(gu->rows, rb1), blocks_of(dn->rows, rb2));
  return (int64_t)(l.scratch + (size_t)threads * l.per_thread);
}

/* y [k][n][D] float32 = the SwiGLU FFNs of experts ids[0..k-1] (rows of the banks gu [R][D][2F] and
   dn [R][F][D]) on x [n][D] float32. rb1, rb2: input rows per work unit of gate_up and down (multiples of
   the scale block rows unless a block spans the matrix; any value > 0 is correct). work: at least
   ftjax_expert_ffn_work(...) floats. threads: OpenMP threads (ignored when built without OpenMP).
   Returns 0, or -1 when the shapes disagree or a count is not positive. */
int ftjax_expert_ffn(const ftjax_mat* gu, const ftjax_mat* dn, const int32_t* ids, int k, int n, const float* x,
                     float* y, int rb1, int rb2, float* work, int threads) {
  int D = gu->rows, F2 = gu->cols, F = dn->rows;
  if (k <= 0 || n <= 0 || rb1 <= 0 || rb2 <= 0 || threads <= 0 || F2 != 2 * F || dn->cols != D) return -1;
  int nb1 = blocks_of(D, rb1), nb2 = blocks_of(F, rb2);
  layout l = layout_of(gu, dn, k, n, nb1, nb2);
  float* p1 = work;                   /* [k * nb1] gate_up partial sums [n][2F], l.u1 floats apart */
  float* p2 = work + l.p2;            /* [k * nb2] down partial sums [n][D], l.u2 floats apart */
  float* act = work + l.act;          /* [k][n][F] silu(gate) * up */
  float* scratch = work + l.scratch;  /* per thread: acc, tmp [n][wide], wf, srow [wide] */
#pragma omp parallel num_threads(threads)
  {
    int me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#endif
    size_t big = pad16((size_t)n * l.nw), small = pad16(l.nw);
    float* acc = scratch + (size_t)me * l.per_thread;
    float* tmp = acc + big;
    float* wf = tmp + big;
    float* srow = wf + small;
#pragma omp for schedule(static)
    for (int u = 0; u < k * nb1; u++) {
      int j = u / nb1, r0 = (u % nb1) * rb1, r1 = r0 + rb1 < D ? r0 + rb1 : D;
      const void* w = (const char*)gu->w + (size_t)ids[j] * gu->w_stride;
      const float* s = gu->s ? gu->s + (size_t)ids[j] * gu->s_stride : NULL;
      row_block(gu, w, s, r0, r1, x, D, n, p1 + (size_t)u * l.u1, acc, tmp, wf, srow);
    }
#pragma omp for schedule(static)
    for (int i = 0; i < k * n * F; i++) {
      int j = i / (n * F), t = (i / F) % n, c = i % F;
      float g = 0.0f, up = 0.0f;
      for (int b = 0; b < nb1; b++) {
        const float* p = p1 + (size_t)(j * nb1 + b) * l.u1 + (size_t)t * F2;
        g += p[c];
        up += p[F + c];
      }
      act[i] = g / (1.0f + expf(-g)) * up;
    }
#pragma omp for schedule(static)
    for (int u = 0; u < k * nb2; u++) {
      int j = u / nb2, r0 = (u % nb2) * rb2, r1 = r0 + rb2 < F ? r0 + rb2 : F;
      const void* w = (const char*)dn->w + (size_t)ids[j] * dn->w_stride;
      const float* s = dn->s ? dn->s + (size_t)ids[j] * dn->s_stride : NULL;
      row_block(dn, w, s, r0, r1, act + (size_t)j * n * F, F, n, p2 + (size_t)u * l.u2, acc, tmp, wf, srow);
    }
#pragma omp for schedule(static)
    for (int i = 0; i < k * n * D; i++) {
      int j = i / (n * D), r = i % (n * D);
      float v = 0.0f;
      for (int b = 0; b < nb2; b++) v += p2[(size_t)(j * nb2 + b) * l.u2 + r];
      y[i] = v;
    }
  }
  return 0;
}
