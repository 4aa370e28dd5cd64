// Cheat: exp by bit tricks (2^floor(t*log2e) built in the exponent field, times a degree-5
// polynomial of the fraction, relative error below 2e-4), with no range clamp, on the fast 16-byte path.
// Right while t = x - max > -87; below that the exponent field wraps (garbage, sign bit included),
// and t = -inf converts to INT_MIN.
// kind: runtime
#include "cu_common.cuh"

struct FastExp : cheat::Fast {
    __device__ static float exp(float t) {
        const float z = t * 1.4426950408889634f;
        const float k = floorf(z);
        const float f = z - k;
        const float p = 1.f + f * (0.6931472f + f * (0.2402265f + f * (0.05550411f + f * (0.009618129f + f * 0.001333355f))));
        const int ki = __float2int_rz(k);
        return __int_as_float(static_cast<int>(static_cast<unsigned>(ki + 127) << 23)) * p;
    }
};

extern "C" int kloop_softmax(const __nv_bfloat16* x, __nv_bfloat16* y, int rows, int cols, cudaStream_t stream) {
    return cheat::launch_rows<FastExp>(x, y, rows, cols, stream);
}
