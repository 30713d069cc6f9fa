// matmul.cu: the linear's GEMMs through cuBLASLt, row-major as nn.Linear
// (src/kernels/matmul.c): out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias.
// cuBLASLt is column-major, so each row-major product is issued transposed,
// as llm.c's matmul_forward_cublaslt does:
//   forward  out^T (OC,N) = W^T-op of weight (C,OC col-major) x inp^T (C,N)
//   dinp^T  (C,N)  += weight (C,OC col-major) x dout^T (OC,N)
//   dW^T    (C,OC) += inp^T (C,N) x T-op of dout^T (OC,N col-major)
// Operands in the storage dtype, fp32 accumulation (CUBLAS_COMPUTE_32F;
// fp32 GEMMs in full fp32, TF32 only with FITLM_TF32=1), the gradients
// accumulated by beta = 1 and rounded once. The bias rides on the forward's
// epilogue; its gradient is a deterministic column sum (columns.cuh).
// GPT-2's MLP GELU may ride on epilogues too (llm.c's gelu_fusion, device.h):
// the forward's GELU_AUX(_BIAS), which keeps the GELU's input in the aux
// matrix, and the input gradient's DGELU, which reads it back.
// Descriptors and the algorithm are chosen once per (GEMM, dtype, shape,
// epilogue, operand alignment, workspace) and cached: a fixed algorithm on
// a fixed GPU gives the same bits every step.
#include <cublasLt.h>
#include <stdlib.h>
#include <string.h>

#include "columns.cuh"

// What the model allocates and passes as `workspace` (FL_MEM_WORKSPACE, so
// the plan counts it): cuBLASLt's scratch, llm.c's size.
#define MM_WORKSPACE ((size_t)32 << 20)

enum { MM_FORWARD, MM_DINP, MM_DWEIGHT };

static void blas_check(cublasStatus_t st, const char *call, const char *file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS)
        fl_die("cuda: %s failed at %s:%d: %s (%s)", call, file, line, cublasLtGetStatusString(st),
               cublasLtGetStatusName(st));
}
#define FL_BLAS_CHECK(call) blas_check((call), #call, __FILE__, __LINE__)

typedef struct {
    int kind, bias, gelu, align; // gelu: the GELU's input in the aux matrix (GELU_AUX or DGELU)
    int none;                    // an epilogue cuBLASLt has no algorithm for here
    fl_dtype dt;
    int m, n, k;
    size_t ws;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} plan;

static struct {
    cublasLtHandle_t handle;
    plan *plans;
    size_t n_plans, cap;
    int tf32; // FITLM_TF32=1
} mm;

static cudaDataType_t data_type(fl_dtype dt) {
    return dt == FL_F32 ? CUDA_R_32F : dt == FL_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// the largest power of two up to 256 that divides every address
static int alignment_of(const void *a, const void *b, const void *c) {
    uintptr_t bits = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | 256;
    return (int)(bits & (~bits + 1));
}

extern "C" void fl_cuda_matmul_init(void) {
    if (mm.handle) return;
    FL_BLAS_CHECK(cublasLtCreate(&mm.handle));
    const char *tf32 = getenv("FITLM_TF32");
    mm.tf32 = tf32 && !strcmp(tf32, "1");
}

static const char *gemm_name(int kind) {
    return kind == MM_FORWARD ? "forward" : kind == MM_DINP ? "input-gradient" : "weight-gradient";
}

// Fills p's descriptors for D (m,n) = op(A) (m,k) x op(B) (k,n),
// column-major; A transposed for the forward, B for the weight gradient.
static void plan_init(plan *p, int kind, fl_dtype dt, int m, int n, int k, int bias, int gelu,
                      int align, size_t ws) {
    fl_cuda_matmul_init();
    memset(p, 0, sizeof *p);
    p->kind = kind, p->bias = bias, p->gelu = gelu, p->align = align, p->dt = dt;
    p->m = m, p->n = n, p->k = k, p->ws = ws;
    cublasComputeType_t compute =
        dt == FL_F32 && mm.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    FL_BLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F));
    cublasOperation_t ta = kind == MM_FORWARD ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = kind == MM_DWEIGHT ? CUBLAS_OP_T : CUBLAS_OP_N;
    FL_BLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    FL_BLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (bias || gelu) {
        cublasLtEpilogue_t epi = !gelu             ? CUBLASLT_EPILOGUE_BIAS
                                 : kind == MM_DINP ? CUBLASLT_EPILOGUE_DGELU
                                 : bias            ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                   : CUBLASLT_EPILOGUE_GELU_AUX;
        FL_BLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                     sizeof epi));
    }
    if (bias) {
        cudaDataType_t bt = data_type(dt);
        FL_BLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bt, sizeof bt));
    }
    if (gelu) { // the GELU's input, D's type and shape
        int64_t ld = m;
        FL_BLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                     &ld, sizeof ld));
    }
    cudaDataType_t t = data_type(dt);
    // stored shapes (rows, cols, leading dimension), column-major
    uint64_t ar = ta == CUBLAS_OP_T ? k : m, ac = ta == CUBLAS_OP_T ? m : k;
    uint64_t br = tb == CUBLAS_OP_T ? n : k, bc = tb == CUBLAS_OP_T ? k : n;
    FL_BLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, t, ar, ac, (int64_t)ar));
    FL_BLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, t, br, bc, (int64_t)br));
    FL_BLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, t, m, n, (int64_t)m));
}

// cuBLASLt's first `want` algorithms for p (its heuristic's order) into
// res; dies naming the GEMM when it has none, unless may_lack.
static int heuristics(const plan *p, int want, cublasLtMatmulHeuristicResult_t *res, int may_lack) {
    cublasLtMatmulPreference_t pref;
    FL_BLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    FL_BLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &p->ws, sizeof p->ws));
    uint32_t al = (uint32_t)p->align;
    cublasLtMatmulPreferenceAttributes_t aligns[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++)
        FL_BLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &al, sizeof al));
    int found = 0;
    // (a configuration it has no kernel for may say NOT_SUPPORTED, found 0)
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(mm.handle, p->desc, p->a, p->b, p->c, p->c,
                                                       pref, want, res, &found);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED || !may_lack)
        blas_check(st, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    FL_BLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (found < 1 && !may_lack)
        fl_die("cuda: cuBLASLt has no algorithm for the %s GEMM m=%d n=%d k=%d in %s (operands "
               "%d-byte aligned, workspace %zu bytes)",
               gemm_name(p->kind), p->m, p->n, p->k, fl_dtype_name(p->dt), p->align, p->ws);
    return found;
}

// The cached plan of a GEMM: its descriptors and the heuristic's first
// algorithm. An epilogue (bias, GELU) cuBLASLt lacks an algorithm for (a
// dtype or shape its kernels do not cover) is said once, and the plan
// marked none: the caller runs the GEMM and the bias or GELU kernel apart.
static plan *get_plan(int kind, fl_dtype dt, int m, int n, int k, int bias, int gelu, int align,
                      size_t ws) {
    for (size_t i = 0; i < mm.n_plans; i++) {
        plan *p = &mm.plans[i];
        if (p->kind == kind && p->dt == dt && p->m == m && p->n == n && p->k == k &&
            p->bias == bias && p->gelu == gelu && p->align == align && p->ws == ws)
            return p;
    }
    mm.plans = (plan *)fl_reserve(FL_MEM_OTHER, mm.plans, &mm.cap, mm.n_plans, mm.n_plans + 1,
                                  sizeof(plan));
    plan *p = &mm.plans[mm.n_plans];
    plan_init(p, kind, dt, m, n, k, bias, gelu, align, ws);
    cublasLtMatmulHeuristicResult_t res;
    p->none = heuristics(p, 1, &res, gelu || bias) < 1;
    if (p->none)
        fl_warn("cuda: cuBLASLt has no algorithm for the %s GEMM m=%d n=%d k=%d in %s with the "
                "%s epilogue: the GEMM and the %s kernel run apart",
                gemm_name(kind), m, n, k, fl_dtype_name(dt), gelu ? "GELU" : "bias",
                gelu ? "GELU" : "bias");
    else
        p->algo = res.algo;
    mm.n_plans++;
    return p;
}

// The workspace from its first 256-byte boundary (the model's buffer may
// sit at any 64-byte offset of an arena), and its bytes from there.
static size_t workspace_from(void **workspace) {
    if (!*workspace) return 0;
    uintptr_t at = ((uintptr_t)*workspace + 255) & ~(uintptr_t)255;
    size_t ws = MM_WORKSPACE - (at - (uintptr_t)*workspace);
    *workspace = (void *)at;
    return ws;
}

// One of the linear's GEMMs as cuBLASLt's D (m,n) = A x B + beta D
// (column-major, the header's table): its operands among the linear's
// buffers and its shape, for kind MM_FORWARD, MM_DINP or MM_DWEIGHT.
typedef struct {
    int kind, m, n, k;
    void *d;
    const void *a, *b;
    float beta; // 1: the gradient accumulates (0: D is written, never read)
} gemm_call;

// The weight gradient accumulates; the input gradient only with dinp_add.
static gemm_call linear_gemm(int kind, void *out, const void *inp, const void *weight, void *dinp,
                             void *dweight, const void *dout, int N, int C, int OC, int dinp_add) {
    if (kind == MM_FORWARD) return gemm_call{kind, OC, N, C, out, weight, inp, 0.0f};
    if (kind == MM_DINP)
        return gemm_call{kind, C, N, OC, dinp, weight, dout, dinp_add ? 1.0f : 0.0f};
    return gemm_call{kind, C, OC, N, dweight, inp, dout, 1.0f};
}

// g on the compute stream, with the bias on its epilogue when given, and
// with pre GELU's: a forward's D = gelu(product + bias), pre = product +
// bias; an input gradient's D = product * gelu'(pre). 0 when cuBLASLt has
// no algorithm for that epilogue here (nothing issued).
static int gemm(fl_dtype dt, gemm_call g, const void *bias, const void *pre, void *workspace) {
    size_t ws = workspace_from(&workspace);
    plan *p = get_plan(g.kind, dt, g.m, g.n, g.k, bias != NULL, pre != NULL,
                       alignment_of(g.a, g.b, g.d), ws);
    if (p->none) return 0;
    if (bias)
        FL_BLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bias, sizeof bias));
    if (pre)
        FL_BLAS_CHECK(cublasLtMatmulDescSetAttribute(
            p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &pre, sizeof pre));
    const float alpha = 1.0f;
    FL_BLAS_CHECK(cublasLtMatmul(mm.handle, p->desc, &alpha, g.a, p->a, g.b, p->b, &g.beta, g.d,
                                 p->c, g.d, p->c, &p->algo, workspace, ws, fl_cuda_stream()));
    fl_cuda_issued();
    return 1;
}

// chunk blockIdx.y of the rows of dout (N,OC): partial[chunk][o] = its column sums
__global__ void bias_columns_kernel(fl_dtype dt, float *partial, const void *dout, int N, int OC) {
    __shared__ float sb[COL_WARPS][COL_THREADS];
    int tx = threadIdx.x % COL_THREADS, ty = threadIdx.x / COL_THREADS;
    int o = blockIdx.x * COL_THREADS + tx, chunk = blockIdx.y, chunks = gridDim.y;
    int per = (N + chunks - 1) / chunks, r0 = chunk * per, r1 = min(N, r0 + per);
    float s = 0.0f;
    if (o < OC)
        for (int n = r0 + ty; n < r1; n += COL_WARPS) s += fl_d_load(dt, dout, (size_t)n * OC + o);
    sb[ty][tx] = s;
    __syncthreads();
    if (ty != 0 || o >= OC) return;
    s = 0.0f;
    for (int w = 0; w < COL_WARPS; w++) s += sb[w][tx];
    partial[(size_t)chunk * OC + o] = s;
}

extern "C" size_t fl_cuda_matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC) {
    (void)dt, (void)N, (void)C, (void)OC;
    return MM_WORKSPACE;
}

// The bias rides on the epilogue (rounded once with the product) when its
// pointer is 16-byte aligned and cuBLASLt has an algorithm for it;
// otherwise it is added after, rounded again under 16-bit storage.
extern "C" void fl_cuda_matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                                       const void *bias, void *workspace, int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    gemm_call g = linear_gemm(MM_FORWARD, out, inp, weight, NULL, NULL, NULL, N, C, OC, 0);
    if (bias && (uintptr_t)bias % 16 == 0 && gemm(dt, g, bias, NULL, workspace)) return;
    gemm(dt, g, NULL, NULL, workspace);
    if (bias) fl_cuda_bias_forward(dt, out, bias, N, OC);
}

// (device.h, set when FITLM_CUDA_GELU_FUSION=1 or 2) the GELU epilogue
// needs the bias and the pre-activation 16-byte aligned and OC a multiple
// of 8 (the aux's leading dimension), and cuBLASLt an algorithm for it:
// otherwise the two kernels, the same result
extern "C" void fl_cuda_matmul_gelu_forward(fl_dtype dt, void *out, void *pre, const void *inp,
                                            const void *weight, const void *bias, void *workspace,
                                            int N, int C, int OC) {
    if (N <= 0 || OC <= 0) return;
    int epilogue = (!bias || (uintptr_t)bias % 16 == 0) && (uintptr_t)pre % 16 == 0 && OC % 8 == 0;
    if (epilogue &&
        gemm(dt, linear_gemm(MM_FORWARD, out, inp, weight, NULL, NULL, NULL, N, C, OC, 0), bias,
             pre, workspace))
        return;
    fl_cuda_matmul_forward(dt, pre, inp, weight, bias, workspace, N, C, OC);
    fl_cuda_gelu_forward(dt, out, pre, (size_t)N * OC);
}

// columns.cuh's fl_cuda_column_finish: a block's COL_WARPS warps each
// add every COL_WARPS-th chunk of COL_THREADS columns (chunk w,
// w + COL_WARPS, ...: their loads in flight together, where one thread a
// column waits out each in turn), then their sums are added in warp order.
__global__ void column_finish_kernel(fl_dtype dt, void *dst, const float *partial, int chunks,
                                     int C) {
    __shared__ float part[COL_WARPS][COL_THREADS];
    int tx = threadIdx.x % COL_THREADS, ty = threadIdx.x / COL_THREADS;
    int c = blockIdx.x * COL_THREADS + tx;
    float s = 0.0f;
    if (c < C)
#pragma unroll 4
        for (int r = ty; r < chunks; r += COL_WARPS) s += partial[(size_t)r * C + c];
    part[ty][tx] = s;
    __syncthreads();
    if (ty != 0 || c >= C) return;
    float t = 0.0f;
    for (int w = 0; w < COL_WARPS; w++) t += part[w][tx];
    fl_d_store(dt, dst, c, fl_d_load(dt, dst, c) + t);
}

void fl_cuda_column_finish(fl_dtype dt, void *dst, const float *partial, int chunks, int C) {
    column_finish_kernel<<<(unsigned)((C + COL_THREADS - 1) / COL_THREADS), COL_THREADS * COL_WARPS,
                           0, fl_cuda_stream()>>>(dt, dst, partial, chunks, C);
    FL_CUDA_LAUNCHED("column_finish");
}

// The backward's GEMMs; with pre (dinp_add 0) the input gradient leaves
// through GELU's backward: in the GEMM's DGELU epilogue where dinp and pre
// are 16-byte aligned, C is a multiple of 8 (the aux's leading dimension)
// and cuBLASLt has an algorithm for it, else gelu_backward in place after
static void backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                     const void *inp, const void *weight, const void *pre, void *workspace, int N,
                     int C, int OC, int dinp_add) {
    if (N <= 0 || OC <= 0 || C <= 0) return;
    if (dinp) {
        gemm_call g = linear_gemm(MM_DINP, NULL, inp, weight, dinp, NULL, dout, N, C, OC, dinp_add);
        int epilogue = pre && (uintptr_t)pre % 16 == 0 && (uintptr_t)dinp % 16 == 0 && C % 8 == 0;
        if (!epilogue || !gemm(dt, g, NULL, pre, workspace)) {
            gemm(dt, g, NULL, NULL, workspace);
            if (pre) fl_cuda_gelu_backward(dt, dinp, pre, dinp, (size_t)N * C);
        }
    }
    if (dweight)
        gemm(dt, linear_gemm(MM_DWEIGHT, NULL, inp, weight, NULL, dweight, dout, N, C, OC, 1), NULL,
             NULL, workspace);
    if (!dbias) return;
    int chunks = column_chunks(N);
    float *partial = (float *)fl_cuda_scratch((size_t)chunks * OC * sizeof(float));
    dim3 grid((unsigned)((OC + COL_THREADS - 1) / COL_THREADS), (unsigned)chunks);
    bias_columns_kernel<<<grid, COL_THREADS * COL_WARPS, 0, fl_cuda_stream()>>>(dt, partial, dout,
                                                                                N, OC);
    FL_CUDA_LAUNCHED("bias_columns_kernel");
    fl_cuda_column_finish(dt, dbias, partial, chunks, OC);
}

extern "C" void fl_cuda_matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias,
                                        const void *dout, const void *inp, const void *weight,
                                        void *workspace, int N, int C, int OC, int dinp_add) {
    backward(dt, dinp, dweight, dbias, dout, inp, weight, NULL, workspace, N, C, OC, dinp_add);
}

// (device.h, set when FITLM_CUDA_GELU_FUSION=2)
extern "C" void fl_cuda_matmul_dgelu_backward(fl_dtype dt, void *dpre, void *dweight, void *dbias,
                                              const void *dout, const void *inp, const void *weight,
                                              const void *pre, void *workspace, int N, int C,
                                              int OC) {
    backward(dt, dpre, dweight, dbias, dout, inp, weight, pre, workspace, N, C, OC, 0);
}

// (cuda.h) The buffers are the caller's; as a model's backward issues
// them, dinp is overwritten and dweight accumulates at every call.
extern "C" int fl_cuda_matmul_algos_ms(fl_dtype dt, int kind, void *out, const void *inp,
                                       const void *weight, void *dinp, void *dweight,
                                       const void *dout, void *workspace, int N, int C, int OC,
                                       int algos, int rounds, double *ms) {
    FL_ASSERT(algos >= 1 && rounds >= 1);
    gemm_call g = linear_gemm(kind, out, inp, weight, dinp, dweight, dout, N, C, OC, 0);
    const float alpha = 1.0f;
    size_t ws = workspace_from(&workspace);
    plan p;
    plan_init(&p, kind, dt, g.m, g.n, g.k, 0, 0, alignment_of(g.a, g.b, g.d), ws);
    cublasLtMatmulHeuristicResult_t res[16];
    int found = heuristics(&p, algos < 16 ? algos : 16, res, 0);
    cudaEvent_t e0, e1;
    FL_CUDA_CHECK(cudaEventCreate(&e0));
    FL_CUDA_CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < found; i++)
        for (int r = 0; r <= rounds; r++) {
            if (r == 1) FL_CUDA_CHECK(cudaEventRecord(e0, fl_cuda_stream()));
            FL_BLAS_CHECK(cublasLtMatmul(mm.handle, p.desc, &alpha, g.a, p.a, g.b, p.b, &g.beta,
                                         g.d, p.c, g.d, p.c, &res[i].algo, workspace, ws,
                                         fl_cuda_stream()));
            if (r == rounds) {
                FL_CUDA_CHECK(cudaEventRecord(e1, fl_cuda_stream()));
                fl_cuda_waited(); // the GEMM bench's timing, not a step's
                FL_CUDA_CHECK(cudaEventSynchronize(e1));
                float t = 0.0f;
                FL_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
                ms[i] = t / rounds;
            }
        }
    FL_CUDA_CHECK(cudaEventDestroy(e0));
    FL_CUDA_CHECK(cudaEventDestroy(e1));
    FL_BLAS_CHECK(cublasLtMatrixLayoutDestroy(p.a));
    FL_BLAS_CHECK(cublasLtMatrixLayoutDestroy(p.b));
    FL_BLAS_CHECK(cublasLtMatrixLayoutDestroy(p.c));
    FL_BLAS_CHECK(cublasLtMatmulDescDestroy(p.desc));
    return found;
}
