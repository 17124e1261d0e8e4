// flashgen forward kernel, FA2-class (Dao 2023, "FlashAttention-2", Algorithm 1), for sm_80 and later.
// Spec: t5_bias   dtype bf16   head_dim 64/64   causal False
//
// Glossary
//   BLOCK_M   query rows per CTA (the sQ tile); each warp owns WARP_M = BLOCK_M / NUM_WARPS of them
//   BLOCK_N   key/value rows per inner step (the sK and sV tiles)
//   MT        16-row mma tiles per warp (WARP_M / 16)
//   NT        8-column tiles of the score block S (BLOCK_N / 8)
//   DT        8-column tiles of the output O (HEAD_DIM_V / 8)
//   sQ sK sV  shared-memory tiles, rows of 16-byte chunks, XOR-swizzled (fg::swz)
//   acc_s     S = Q K^T for this warp's rows, fp32 (then P, in place)
//   acc_o     O = P V accumulator, fp32, rescaled lazily, divided by row_sum once at the end
//   row_max   running max of the log2-domain scores; row_sum running sum of exp2(x - row_max)
// Softmax runs in the exp2 domain: x = log2(e) * score_mod(softmax_scale * q.k).
// causal is bottom-right aligned: kv_idx <= q_idx + seqlen_k - seqlen_q.
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
constexpr int HEAD_DIM = 64;
constexpr int HEAD_DIM_V = 64;
constexpr int BLOCK_M = 128;
constexpr int BLOCK_N = 64;
constexpr int NUM_WARPS = 4;
constexpr int THREADS = NUM_WARPS * 32;
constexpr int WARP_M = BLOCK_M / NUM_WARPS;
constexpr int MT = WARP_M / 16;
constexpr int NT = BLOCK_N / 8;
constexpr int DT = HEAD_DIM_V / 8;
constexpr int Q_ROW_BYTES = HEAD_DIM * 2;
constexpr int V_ROW_BYTES = HEAD_DIM_V * 2;
constexpr int SQ_BYTES = BLOCK_M * (HEAD_DIM > HEAD_DIM_V ? HEAD_DIM : HEAD_DIM_V) * 2;  // also stages O
constexpr int SK_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr bool IS_CAUSAL = false;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
using elem_t = __nv_bfloat16;
using Mma = fg::MmaOp<elem_t>;
static_assert(WARP_M % 16 == 0 && BLOCK_N % 16 == 0 && HEAD_DIM % 64 == 0 && HEAD_DIM_V % 64 == 0,
              "tile shape");

// Copy `rows` x `cols` elements (row stride `stride`) into a swizzled tile; rows >= valid_rows read as 0.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_tile(uint32_t dst, const elem_t* src, int64_t stride, int valid_rows) {
    constexpr int CHUNKS_PER_ROW = COLS / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    #pragma unroll
    for (int i = threadIdx.x; i < CHUNKS; i += THREADS) {
        const int row = i / CHUNKS_PER_ROW, chunk = i % CHUNKS_PER_ROW;
        const bool valid = row < valid_rows;
        const elem_t* g = src + (valid ? row * stride + chunk * 8 : 0);
        fg::cp_async_16(dst + fg::swz(row, chunk, COLS * 2), g, valid);
    }
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1) flashgen_t5_bias_fwd_sm_80(
    const __nv_bfloat16* __restrict__ q,
    const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v,
    __nv_bfloat16* __restrict__ o,
    float* __restrict__ lse,
    int64_t q_sb,
    int64_t q_sh,
    int64_t q_ss,
    int64_t k_sb,
    int64_t k_sh,
    int64_t k_ss,
    int64_t v_sb,
    int64_t v_sh,
    int64_t v_ss,
    int64_t o_sb,
    int64_t o_sh,
    int64_t o_ss,
    int batch,
    int heads_q,
    int heads_kv,
    int seqlen_q,
    int seqlen_k,
    float softmax_scale,
    const float* __restrict__ t_bias
) {
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = fg::smem_u32(smem);
    const uint32_t sK = sQ + SQ_BYTES;
    const uint32_t sV = sK + SK_BYTES;

    // Which (batch, head, query block) this CTA computes; heaviest causal blocks first.
    const int num_m_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int m_rev = blockIdx.x % num_m_blocks;
    const int m_block = IS_CAUSAL ? num_m_blocks - 1 - m_rev : m_rev;
    const int bh = blockIdx.x / num_m_blocks;
    const int b = bh / heads_q;
    const int h = bh % heads_q;
    const int h_kv = h / (heads_q / heads_kv);
    const int m0 = m_block * BLOCK_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    const elem_t* q_blk = q + b * q_sb + h * q_sh + (int64_t)m0 * q_ss;
    const elem_t* k_head = k + b * k_sb + h_kv * k_sh;
    const elem_t* v_head = v + b * v_sb + h_kv * v_sh;

    // KV range: everything, or for causal up to the last row's diagonal (blocks past it are never loaded).
    const int kv_end = IS_CAUSAL ? min(seqlen_k, m0 + BLOCK_M + seqlen_k - seqlen_q) : seqlen_k;
    const int n_blocks = kv_end > 0 ? (kv_end + BLOCK_N - 1) / BLOCK_N : 0;
    const float scale_log2 = softmax_scale * LOG2E;

    float acc_o[MT][DT][4];
    float row_max[MT][2], row_sum[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            #pragma unroll
            for (int i = 0; i < 4; ++i) acc_o[mt][dt][i] = 0.f;
        #pragma unroll
        for (int r = 0; r < 2; ++r) { row_max[mt][r] = -INFINITY; row_sum[mt][r] = 0.f; }
    }

    // Prologue: Q tile and the first K tile in flight.
    if (n_blocks > 0) {
        load_tile<BLOCK_M, HEAD_DIM>(sQ, q_blk, q_ss, seqlen_q - m0);
        const int n_last = (n_blocks - 1) * BLOCK_N;
        load_tile<BLOCK_N, HEAD_DIM>(sK, k_head + (int64_t)n_last * k_ss, k_ss, seqlen_k - n_last);
        fg::cp_async_commit();
    }

    for (int n_block = n_blocks - 1; n_block >= 0; --n_block) {
        const int n0 = n_block * BLOCK_N;
        // K(n) has landed and every warp is done with V(n+1): start V(n).
        fg::cp_async_wait_all();
        __syncthreads();
        load_tile<BLOCK_N, HEAD_DIM_V>(sV, v_head + (int64_t)n0 * v_ss, v_ss, seqlen_k - n0);
        fg::cp_async_commit();

        // S = Q K^T on tensor cores.
        float acc_s[MT][NT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) acc_s[mt][nt][i] = 0.f;
        #pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            uint32_t a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                fg::ldmatrix_x4(a[mt], sQ + fg::swz(warp * WARP_M + mt * 16 + (lane % 16), kk * 2 + lane / 16, Q_ROW_BYTES));
            #pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                uint32_t bk[4];
                fg::ldmatrix_x4(bk, sK + fg::swz(np * 16 + (lane % 8) + (lane / 16) * 8, kk * 2 + (lane / 8) % 2, Q_ROW_BYTES));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma::run(acc_s[mt][2 * np], a[mt], bk[0], bk[1]);
                    Mma::run(acc_s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                }
            }
        }

        // Scores -> log2 domain, with score_mod and the mask applied elementwise.
        const bool edge = n0 + BLOCK_N > seqlen_k || (IS_CAUSAL && n0 + BLOCK_N - 1 > m0 + seqlen_k - seqlen_q);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int q_raw = m0 + warp * WARP_M + mt * 16 + lane / 4 + (i / 2) * 8;
                    const int kv_raw = n0 + nt * 8 + (lane % 4) * 2 + (i % 2);
                    // The DSL sees indices clamped into range (tensor params are read in bounds);
                    // out-of-range pairs are dropped below by selection.
                    const int q_idx = min(q_raw, seqlen_q - 1);
                    const int kv_idx = min(kv_raw, seqlen_k - 1);
                    const float score = acc_s[mt][nt][i] * softmax_scale;
                    float x = (float)((score + t_bias[(fg::clamp_index((int64_t)(h), (int64_t)(heads_q))) * (int64_t)(257) + fg::clamp_index((int64_t)((min(max((kv_idx - q_idx), (-128)), 128) + 128)), (int64_t)(257))])) * LOG2E;
                    if (edge && (kv_raw >= seqlen_k || (IS_CAUSAL && kv_raw > q_raw + seqlen_k - seqlen_q)))
                        x = -INFINITY;
                    acc_s[mt][nt][i] = x;
                }

        // Online softmax: new row max, rescale O and the running sum, P = exp2(x - max).
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = row_max[mt][r];
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * r], acc_s[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
                const float base = mx == -INFINITY ? 0.f : mx;  // a fully masked row so far stays at 0
                const float alpha = fg::exp2_approx(row_max[mt][r] - base);
                row_max[mt][r] = mx;
                float sum = 0.f;
                #pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    #pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const float p = fg::exp2_approx(acc_s[mt][nt][2 * r + j] - base);
                        acc_s[mt][nt][2 * r + j] = p;
                        sum += p;
                    }
                row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
                #pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    acc_o[mt][dt][2 * r] *= alpha;
                    acc_o[mt][dt][2 * r + 1] *= alpha;
                }
            }

        // V(n) has landed and every warp is done with K(n): start K(n-1), then O += P V.
        fg::cp_async_wait_all();
        __syncthreads();
        if (n_block > 0) {
            const int n_prev = n0 - BLOCK_N;
            load_tile<BLOCK_N, HEAD_DIM>(sK, k_head + (int64_t)n_prev * k_ss, k_ss, seqlen_k - n_prev);
            fg::cp_async_commit();
        }
        #pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            uint32_t a[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = Mma::pack(acc_s[mt][2 * kk][0], acc_s[mt][2 * kk][1]);
                a[mt][1] = Mma::pack(acc_s[mt][2 * kk][2], acc_s[mt][2 * kk][3]);
                a[mt][2] = Mma::pack(acc_s[mt][2 * kk + 1][0], acc_s[mt][2 * kk + 1][1]);
                a[mt][3] = Mma::pack(acc_s[mt][2 * kk + 1][2], acc_s[mt][2 * kk + 1][3]);
            }
            #pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                uint32_t bv[4];
                fg::ldmatrix_x4_trans(bv, sV + fg::swz(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dp * 2 + lane / 16, V_ROW_BYTES));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    Mma::run(acc_o[mt][2 * dp], a[mt], bv[0], bv[1]);
                    Mma::run(acc_o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
                }
            }
        }
    }

    // Epilogue: O / row_sum staged through shared memory for 16-byte stores; lse = ln(sum) + max.
    fg::cp_async_wait_all();
    __syncthreads();
    const int64_t lse_row0 = (int64_t)bh * seqlen_q;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = row_sum[mt][r];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            const bool empty = sum == 0.f || row_max[mt][r] == -INFINITY;
            const float inv = empty ? 0.f : 1.f / sum;
            const int row = warp * WARP_M + mt * 16 + lane / 4 + r * 8;
            #pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const uint32_t packed = Mma::pack(acc_o[mt][dt][2 * r] * inv, acc_o[mt][dt][2 * r + 1] * inv);
                const uint32_t addr = sQ + fg::swz(row, dt, V_ROW_BYTES) + (lane % 4) * 4;
                asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(packed));
            }
            if (lane % 4 == 0 && m0 + row < seqlen_q)
                lse[lse_row0 + m0 + row] = empty ? -INFINITY : (row_max[mt][r] + __log2f(sum)) * LN2;
        }
    __syncthreads();
    constexpr int O_CHUNKS_PER_ROW = HEAD_DIM_V / 8;
    elem_t* o_blk = o + b * o_sb + h * o_sh + (int64_t)m0 * o_ss;
    #pragma unroll
    for (int i = threadIdx.x; i < BLOCK_M * O_CHUNKS_PER_ROW; i += THREADS) {
        const int row = i / O_CHUNKS_PER_ROW, chunk = i % O_CHUNKS_PER_ROW;
        if (m0 + row < seqlen_q) {
            uint4 val;
            asm volatile("ld.shared.v4.b32 { %0,%1,%2,%3}, [%4];\n"
                         : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                         : "r"(sQ + fg::swz(row, chunk, V_ROW_BYTES)));
            *reinterpret_cast<uint4*>(o_blk + row * o_ss + chunk * 8) = val;
        }
    }
}
