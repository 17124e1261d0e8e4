// flashgen backward kernels, FA2-class (Dao 2023, "FlashAttention-2", Algorithm 2), for sm_80 and later.
// Spec: document_mask   dtype bf16   head_dim 128/128   causal True
//
// Three kernels, one translation unit; P is recomputed from the saved lse, never stored:
//   flashgen_document_mask_bwd_sm_90_pre   dsum = rowsum(dO * O), one warp per query row
//   flashgen_document_mask_bwd_sm_90_dkdv  KV outer / Q inner: dV = P^T dO, dK = scale * dS^T Q, summed over the GQA group
//   flashgen_document_mask_bwd_sm_90_dq    Q outer / KV inner: dQ = scale * dS K
// with dS = P * (dP - dsum) * d score_mod / d score and dP = dO V^T.  No atomics anywhere:
// each output element is owned by one thread, so gradients are bitwise reproducible.
//
// Glossary
//   KV_N, KV_M  dkdv: key rows per CTA (16 per warp); query rows per inner step
//   DSPLIT      dkdv: CTAs sharing one key block, each owning HEAD_DIM/DSPLIT columns of dK, dV
//   DQ_M, DQ_N  dq: query rows per CTA (16 per warp); key rows per inner step
//   acc_s       S (or S^T) for this warp's 16 rows, then P
//   acc_dp      dP (or dP^T), then dS
//   sLse        lse * log2(e) of the step's query rows (+inf for rows with nothing to attend to)
// Warp-level tensor-core and async-copy primitives for sm_80+ (mma.sync, ldmatrix, cp.async).
// Fragment layouts follow the PTX ISA, "Matrix Fragments for mma.m16n8k16".
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace fg {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; rows past the end are zero-filled (src_bytes = 0 reads nothing).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four 8x8 b16 matrices; thread t supplies the row address of matrix t/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
    // d += a (16x16, row) * b (16x8, col), fp32 accumulators.
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{ %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};
template <> struct MmaOp<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{ %0,%1,%2,%3}, { %4,%5,%6,%7}, { %8,%9}, { %0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows are `row_bytes` wide.
// XOR swizzle over 8 chunks: the 8 rows an ldmatrix reads at one column hit 8 different bank groups.
__device__ __forceinline__ uint32_t swz(int row, int chunk, int row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

}  // namespace fg

namespace fg {
// A tensor-param index clamped into [0, n): DSL reads never leave the param's declared shape.
__device__ __forceinline__ int64_t clamp_index(int64_t i, int64_t n) { return i < 0 ? 0 : (i >= n ? n - 1 : i); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
}  // namespace fg

namespace {
constexpr int HEAD_DIM = 128;
constexpr int HEAD_DIM_V = 128;
constexpr int QK_ROW_BYTES = HEAD_DIM * 2;
constexpr int V_ROW_BYTES = HEAD_DIM_V * 2;
constexpr bool IS_CAUSAL = true;
constexpr float LOG2E = 1.4426950408889634f;
using elem_t = __nv_bfloat16;
using Mma = fg::MmaOp<elem_t>;

constexpr int PRE_WARPS = 8;
constexpr int KV_N = 64;
constexpr int KV_M = 32;
constexpr int KV_WARPS = 4;
constexpr int DSPLIT = 1;
constexpr int DK_COLS = HEAD_DIM / DSPLIT;
constexpr int DV_COLS = HEAD_DIM_V / DSPLIT;
constexpr int DQ_M = 64;
constexpr int DQ_N = 32;
constexpr int DQ_WARPS = 4;
static_assert(KV_N == 16 * KV_WARPS && DQ_M == 16 * DQ_WARPS, "one 16-row mma tile per warp");
static_assert(KV_M % 16 == 0 && DQ_N % 16 == 0 && DK_COLS % 16 == 0 && DV_COLS % 16 == 0, "tiles");

// ROWS x COLS elements (row stride `stride`) into a swizzled tile by THREADS threads; rows >= valid_rows read 0.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t dst, const elem_t* src, int64_t stride, int valid_rows) {
    constexpr int CHUNKS_PER_ROW = COLS / 8;
    #pragma unroll
    for (int i = threadIdx.x; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
        const int row = i / CHUNKS_PER_ROW, chunk = i % CHUNKS_PER_ROW;
        const bool valid = row < valid_rows;
        fg::cp_async_16(dst + fg::swz(row, chunk, COLS * 2), src + (valid ? row * stride + chunk * 8 : 0), valid);
    }
}

// acc (16 x 8*NT, this warp) = A (16 x K rows of `a_tile` starting at a_row) * B^T (8*NT rows of `b_tile`), K = 16*KSTEPS.
template <int NT, int KSTEPS>
__device__ __forceinline__ void gemm_abt(float (&acc)[NT][4], uint32_t a_tile, int a_row, uint32_t b_tile, int row_bytes, int lane) {
    #pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        fg::ldmatrix_x4(a, a_tile + fg::swz(a_row + (lane % 16), kk * 2 + lane / 16, row_bytes));
        #pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t b[4];
            fg::ldmatrix_x4(b, b_tile + fg::swz(np * 16 + (lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2, row_bytes));
            Mma::run(acc[2 * np], a, b[0], b[1]);
            Mma::run(acc[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x 8*DT) += P (16 x 8*NT, registers) * B (8*NT rows of `b_tile`, columns from chunk c0 on).
template <int NT, int DT>
__device__ __forceinline__ void gemm_pb(float (&acc)[DT][4], const float (&p)[NT][4], uint32_t b_tile, int c0, int row_bytes, int lane) {
    #pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
        uint32_t a[4];
        a[0] = Mma::pack(p[2 * kk][0], p[2 * kk][1]);
        a[1] = Mma::pack(p[2 * kk][2], p[2 * kk][3]);
        a[2] = Mma::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = Mma::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        #pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            uint32_t b[4];
            fg::ldmatrix_x4_trans(b, b_tile + fg::swz(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, c0 + dp * 2 + lane / 16, row_bytes));
            Mma::run(acc[2 * dp], a, b[0], b[1]);
            Mma::run(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// Store a warp's 16 x 8*DT accumulator tile, times `scale`, as elem_t pairs; rows >= valid_rows skipped.
template <int DT>
__device__ __forceinline__ void store_acc(elem_t* dst, int64_t row_stride, const float (&acc)[DT][4], float scale, int valid_rows, int lane) {
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = lane / 4 + r * 8;
        if (row < valid_rows) {
            #pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const uint32_t packed = Mma::pack(acc[dt][2 * r] * scale, acc[dt][2 * r + 1] * scale);
                *reinterpret_cast<uint32_t*>(dst + row * row_stride + dt * 8 + (lane % 4) * 2) = packed;
            }
        }
    }
}

__device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * LOG2E; }
}  // namespace


extern "C" __global__ void __launch_bounds__(PRE_WARPS * 32) flashgen_document_mask_bwd_sm_90_pre(
    const __nv_bfloat16* __restrict__ o,
    const __nv_bfloat16* __restrict__ dout,
    float* __restrict__ dsum,
    int64_t o_sb,
    int64_t o_sh,
    int64_t o_ss,
    int64_t dout_sb,
    int64_t dout_sh,
    int64_t dout_ss,
    int batch,
    int heads_q,
    int seqlen_q
) {
    const int64_t row = (int64_t)blockIdx.x * PRE_WARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= (int64_t)batch * heads_q * seqlen_q) return;
    const int64_t s = row % seqlen_q, bh = row / seqlen_q;
    const int64_t bb = bh / heads_q, hh = bh % heads_q;
    const elem_t* o_row = o + bb * o_sb + hh * o_sh + s * o_ss;
    const elem_t* do_row = dout + bb * dout_sb + hh * dout_sh + s * dout_ss;
    float acc = 0.f;
    #pragma unroll
    for (int c = lane * 2; c < HEAD_DIM_V; c += 64)
        acc += fg::to_float(o_row[c]) * fg::to_float(do_row[c]) + fg::to_float(o_row[c + 1]) * fg::to_float(do_row[c + 1]);
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (lane == 0) dsum[row] = acc;
}

extern "C" __global__ void __launch_bounds__(KV_WARPS * 32, 1) flashgen_document_mask_bwd_sm_90_dkdv(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v,
    const __nv_bfloat16* __restrict__ dout,
    const float* __restrict__ lse,
    const float* __restrict__ dsum,
    __nv_bfloat16* __restrict__ dk,
    __nv_bfloat16* __restrict__ dv,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sb,
    int64_t k_sh,
    int64_t k_ss,
    int64_t v_sb,
    int64_t v_sh,
    int64_t v_ss,
    int64_t dout_sb,
    int64_t dout_sh,
    int64_t dout_ss,
    int64_t dk_sb,
    int64_t dk_sh,
    int64_t dk_ss,
    int64_t dv_sb,
    int64_t dv_sh,
    int64_t dv_ss,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int seqlen_k,
    float softmax_scale,
    const int* __restrict__ t_doc_q,
    const int* __restrict__ t_doc_kv
) {
    constexpr int THREADS = KV_WARPS * 32;
    constexpr int NT = KV_M / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sK = fg::smem_u32(smem);
    const uint32_t sV = sK + KV_N * QK_ROW_BYTES;
    const uint32_t sQ0 = sV + KV_N * V_ROW_BYTES;                 // stage s: sQ0 + s * STAGE_BYTES
    constexpr int STAGE_BYTES = KV_M * (QK_ROW_BYTES + V_ROW_BYTES);
    float* sLse = reinterpret_cast<float*>(smem + KV_N * (QK_ROW_BYTES + V_ROW_BYTES) + 2 * STAGE_BYTES);
    float* sDsum = sLse + 2 * KV_M;

    // Which (batch, kv head, key block, column split) this CTA owns.
    const int n_blocks = (seqlen_k + KV_N - 1) / KV_N;
    const int split = blockIdx.x % DSPLIT;
    const int rest = blockIdx.x / DSPLIT;
    const int n_block = rest % n_blocks;
    const int bhkv = rest / n_blocks;
    const int b = bhkv / heads_kv, h_kv = bhkv % heads_kv;
    const int group = heads_q / heads_kv;
    const int n0 = n_block * KV_N;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Query rows that can see this key block: causal skips the blocks above the diagonal.
    const int m_first = IS_CAUSAL ? max(0, n0 - (seqlen_k - seqlen_q)) / KV_M : 0;
    const int m_blocks = (seqlen_q + KV_M - 1) / KV_M;
    const int per_head = max(0, m_blocks - m_first);
    const int steps = group * per_head;

    load_tile<KV_N, HEAD_DIM, THREADS>(sK, k + b * k_sb + h_kv * k_sh + (int64_t)n0 * k_ss, k_ss, seqlen_k - n0);
    load_tile<KV_N, HEAD_DIM_V, THREADS>(sV, v + b * v_sb + h_kv * v_sh + (int64_t)n0 * v_ss, v_ss, seqlen_k - n0);
    fg::cp_async_commit();

    // Step `it` covers query head h_kv * group + it / per_head, rows from (m_first + it % per_head) * KV_M.
    auto issue = [&](int it, int stage) {
        const int hh = h_kv * group + it / per_head;
        const int m0 = (m_first + it % per_head) * KV_M;
        const uint32_t sQ = sQ0 + stage * STAGE_BYTES;
        load_tile<KV_M, HEAD_DIM, THREADS>(sQ, q + b * q_sb + hh * q_sh + (int64_t)m0 * q_ss, q_ss, seqlen_q - m0);
        load_tile<KV_M, HEAD_DIM_V, THREADS>(sQ + KV_M * QK_ROW_BYTES, dout + b * dout_sb + hh * dout_sh + (int64_t)m0 * dout_ss, dout_ss, seqlen_q - m0);
        const int64_t stat0 = ((int64_t)b * heads_q + hh) * seqlen_q + m0;
        for (int i = threadIdx.x; i < KV_M; i += THREADS) {
            const bool valid = m0 + i < seqlen_q;
            sLse[stage * KV_M + i] = valid ? lse_log2(lse[stat0 + i]) : INFINITY;
            sDsum[stage * KV_M + i] = valid ? dsum[stat0 + i] : 0.f;
        }
    };
    if (steps > 0) issue(0, 0);
    fg::cp_async_commit();

    float acc_dk[DK_COLS / 8][4], acc_dv[DV_COLS / 8][4];
    #pragma unroll
    for (int dt = 0; dt < DK_COLS / 8; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_dk[dt][i] = 0.f;
    #pragma unroll
    for (int dt = 0; dt < DV_COLS / 8; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_dv[dt][i] = 0.f;

    for (int it = 0; it < steps; ++it) {
        const int stage = it & 1;
        // Prefetch the next step into the other stage, then wait for this one.
        if (it + 1 < steps) {
            issue(it + 1, stage ^ 1);
            fg::cp_async_commit();
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            fg::cp_async_wait_all();
        }
        __syncthreads();
        const int h = h_kv * group + it / per_head;
        const int m0 = (m_first + it % per_head) * KV_M;
        const uint32_t sQ = sQ0 + stage * STAGE_BYTES;
        const uint32_t sDO = sQ + KV_M * QK_ROW_BYTES;
        const float* lse_s = sLse + stage * KV_M;
        const float* dsum_s = sDsum + stage * KV_M;

        // S^T = K Q^T and dP^T = V dO^T for this warp's 16 key rows.
        float acc_s[NT][4], acc_dp[NT][4];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) { acc_s[nt][i] = 0.f; acc_dp[nt][i] = 0.f; }
        gemm_abt<NT, HEAD_DIM / 16>(acc_s, sK, warp * 16, sQ, QK_ROW_BYTES, lane);
        gemm_abt<NT, HEAD_DIM_V / 16>(acc_dp, sV, warp * 16, sDO, V_ROW_BYTES, lane);

        // P^T from the saved lse; dS^T = P^T (dP^T - dsum) * d score_mod / d score.
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int qi = nt * 8 + (lane % 4) * 2 + (i % 2);
                const int q_idx = min((m0 + qi), seqlen_q - 1);
                const int kv_idx = min((n0 + warp * 16 + lane / 4 + (i / 2) * 8), seqlen_k - 1);
                const bool keep = (m0 + qi) < seqlen_q && (n0 + warp * 16 + lane / 4 + (i / 2) * 8) < seqlen_k
                                  && (!IS_CAUSAL || (n0 + warp * 16 + lane / 4 + (i / 2) * 8) <= (m0 + qi) + seqlen_k - seqlen_q)
                                  && ((t_doc_q[(fg::clamp_index((int64_t)(b), (int64_t)(batch))) * (int64_t)(seqlen_q) + fg::clamp_index((int64_t)(q_idx), (int64_t)(seqlen_q))] == t_doc_kv[(fg::clamp_index((int64_t)(b), (int64_t)(batch))) * (int64_t)(seqlen_k) + fg::clamp_index((int64_t)(kv_idx), (int64_t)(seqlen_k))]));
                const float score = acc_s[nt][i] * softmax_scale;
                const float x = keep ? score * LOG2E : -INFINITY;
                const float g = keep ? 1.f : 0.f;
                (void)q_idx; (void)kv_idx; (void)g;

                const float p = fg::exp2_approx(x - lse_s[qi]);
                acc_s[nt][i] = p;
                acc_dp[nt][i] = p * (acc_dp[nt][i] - dsum_s[qi]) * g;
            }

        // dV += P^T dO and dK += dS^T Q (this CTA's column split).
        gemm_pb<NT, DV_COLS / 8>(acc_dv, acc_s, sDO, split * (DV_COLS / 8), V_ROW_BYTES, lane);
        gemm_pb<NT, DK_COLS / 8>(acc_dk, acc_dp, sQ, split * (DK_COLS / 8), QK_ROW_BYTES, lane);
        __syncthreads();  // this stage is refilled by the prefetch of step it + 2
    }
    fg::cp_async_wait_all();

    const int row0 = n0 + warp * 16;
    store_acc<DK_COLS / 8>(dk + b * dk_sb + h_kv * dk_sh + (int64_t)row0 * dk_ss + split * DK_COLS, dk_ss, acc_dk, softmax_scale, seqlen_k - row0, lane);
    store_acc<DV_COLS / 8>(dv + b * dv_sb + h_kv * dv_sh + (int64_t)row0 * dv_ss + split * DV_COLS, dv_ss, acc_dv, 1.f, seqlen_k - row0, lane);
}

extern "C" __global__ void __launch_bounds__(DQ_WARPS * 32, 1) flashgen_document_mask_bwd_sm_90_dq(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v,
    const __nv_bfloat16* __restrict__ dout,
    const float* __restrict__ lse,
    const float* __restrict__ dsum,
    __nv_bfloat16* __restrict__ dq,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sb,
    int64_t k_sh,
    int64_t k_ss,
    int64_t v_sb,
    int64_t v_sh,
    int64_t v_ss,
    int64_t dout_sb,
    int64_t dout_sh,
    int64_t dout_ss,
    int64_t dq_sb,
    int64_t dq_sh,
    int64_t dq_ss,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int seqlen_k,
    float softmax_scale,
    const int* __restrict__ t_doc_q,
    const int* __restrict__ t_doc_kv
) {
    constexpr int THREADS = DQ_WARPS * 32;
    constexpr int NT = DQ_N / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = fg::smem_u32(smem);
    const uint32_t sDO = sQ + DQ_M * QK_ROW_BYTES;
    const uint32_t sK0 = sDO + DQ_M * V_ROW_BYTES;                 // stage s: sK0 + s * STAGE_BYTES
    constexpr int STAGE_BYTES = DQ_N * (QK_ROW_BYTES + V_ROW_BYTES);

    const int m_blocks = (seqlen_q + DQ_M - 1) / DQ_M;
    const int m_rev = blockIdx.x % m_blocks;
    const int m_block = IS_CAUSAL ? m_blocks - 1 - m_rev : m_rev;
    const int bh = blockIdx.x / m_blocks;
    const int b = bh / heads_q, h = bh % heads_q;
    const int h_kv = h / (heads_q / heads_kv);
    const int m0 = m_block * DQ_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kv_end = IS_CAUSAL ? min(seqlen_k, m0 + DQ_M + seqlen_k - seqlen_q) : seqlen_k;
    const int n_blocks = kv_end > 0 ? (kv_end + DQ_N - 1) / DQ_N : 0;

    load_tile<DQ_M, HEAD_DIM, THREADS>(sQ, q + b * q_sb + h * q_sh + (int64_t)m0 * q_ss, q_ss, seqlen_q - m0);
    load_tile<DQ_M, HEAD_DIM_V, THREADS>(sDO, dout + b * dout_sb + h * dout_sh + (int64_t)m0 * dout_ss, dout_ss, seqlen_q - m0);
    fg::cp_async_commit();
    const elem_t* k_head = k + b * k_sb + h_kv * k_sh;
    const elem_t* v_head = v + b * v_sb + h_kv * v_sh;
    auto issue = [&](int n_block, int stage) {
        const int n0 = n_block * DQ_N;
        const uint32_t sK = sK0 + stage * STAGE_BYTES;
        load_tile<DQ_N, HEAD_DIM, THREADS>(sK, k_head + (int64_t)n0 * k_ss, k_ss, seqlen_k - n0);
        load_tile<DQ_N, HEAD_DIM_V, THREADS>(sK + DQ_N * QK_ROW_BYTES, v_head + (int64_t)n0 * v_ss, v_ss, seqlen_k - n0);
    };
    if (n_blocks > 0) issue(0, 0);
    fg::cp_async_commit();

    // This thread's two rows: lse (log2 domain) and dsum.
    float row_lse[2], row_dsum[2];
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = m0 + warp * 16 + lane / 4 + r * 8;
        const int64_t stat = ((int64_t)b * heads_q + h) * seqlen_q + row;
        row_lse[r] = row < seqlen_q ? lse_log2(lse[stat]) : INFINITY;
        row_dsum[r] = row < seqlen_q ? dsum[stat] : 0.f;
    }

    float acc_dq[HEAD_DIM / 8][4];
    #pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; ++dt)
        #pragma unroll
        for (int i = 0; i < 4; ++i) acc_dq[dt][i] = 0.f;

    for (int n_block = 0; n_block < n_blocks; ++n_block) {
        const int stage = n_block & 1;
        if (n_block + 1 < n_blocks) {
            issue(n_block + 1, stage ^ 1);
            fg::cp_async_commit();
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            fg::cp_async_wait_all();
        }
        __syncthreads();
        const int n0 = n_block * DQ_N;
        const uint32_t sK = sK0 + stage * STAGE_BYTES;
        const uint32_t sV = sK + DQ_N * QK_ROW_BYTES;

        // S = Q K^T and dP = dO V^T for this warp's 16 query rows.
        float acc_s[NT][4], acc_dp[NT][4];
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) { acc_s[nt][i] = 0.f; acc_dp[nt][i] = 0.f; }
        gemm_abt<NT, HEAD_DIM / 16>(acc_s, sQ, warp * 16, sK, QK_ROW_BYTES, lane);
        gemm_abt<NT, HEAD_DIM_V / 16>(acc_dp, sDO, warp * 16, sV, V_ROW_BYTES, lane);

        // dS = P (dP - dsum) * d score_mod / d score, P recomputed from lse.
        #pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int q_idx = min((m0 + warp * 16 + lane / 4 + (i / 2) * 8), seqlen_q - 1);
                const int kv_idx = min((n0 + nt * 8 + (lane % 4) * 2 + (i % 2)), seqlen_k - 1);
                const bool keep = (m0 + warp * 16 + lane / 4 + (i / 2) * 8) < seqlen_q && (n0 + nt * 8 + (lane % 4) * 2 + (i % 2)) < seqlen_k
                                  && (!IS_CAUSAL || (n0 + nt * 8 + (lane % 4) * 2 + (i % 2)) <= (m0 + warp * 16 + lane / 4 + (i / 2) * 8) + seqlen_k - seqlen_q)
                                  && ((t_doc_q[(fg::clamp_index((int64_t)(b), (int64_t)(batch))) * (int64_t)(seqlen_q) + fg::clamp_index((int64_t)(q_idx), (int64_t)(seqlen_q))] == t_doc_kv[(fg::clamp_index((int64_t)(b), (int64_t)(batch))) * (int64_t)(seqlen_k) + fg::clamp_index((int64_t)(kv_idx), (int64_t)(seqlen_k))]));
                const float score = acc_s[nt][i] * softmax_scale;
                const float x = keep ? score * LOG2E : -INFINITY;
                const float g = keep ? 1.f : 0.f;
                (void)q_idx; (void)kv_idx; (void)g;

                const float p = fg::exp2_approx(x - row_lse[i / 2]);
                acc_dp[nt][i] = p * (acc_dp[nt][i] - row_dsum[i / 2]) * g;
            }

        // dQ += dS K.
        gemm_pb<NT, HEAD_DIM / 8>(acc_dq, acc_dp, sK, 0, QK_ROW_BYTES, lane);
        __syncthreads();  // this stage is refilled by the prefetch of block n_block + 2
    }
    fg::cp_async_wait_all();

    const int row0 = m0 + warp * 16;
    store_acc<HEAD_DIM / 8>(dq + b * dq_sb + h * dq_sh + (int64_t)row0 * dq_ss, dq_ss, acc_dq, softmax_scale, seqlen_q - row0, lane);
}
