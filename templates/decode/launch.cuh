{# Host side: the kernel's shared-memory setup, the facts the split heuristic asks for, and
   launch_decode (included by kernels.cu.j2). #}
constexpr int DYNAMIC_SMEM = static_cast<int>(sizeof(SharedStorage));

// Raise the kernel's dynamic shared memory limit once per device.
void prepare_kernel(int device) {
  static bool prepared[64] = {};
  if (device >= 0 && device < 64 && !prepared[device]) {
    cudaFuncSetAttribute(decode_chunk, cudaFuncAttributeMaxDynamicSharedMemorySize, DYNAMIC_SMEM);
    prepared[device] = true;
  }
}

// Rows of one pipeline stage: the split cuts chunks in whole tiles of this many rows.
int decode_tile_rows() { return TILE; }

// CTAs of decode_chunk that fit on one SM at once: the split heuristic sizes waves with it.
int decode_ctas_per_sm() {
  int device = 0, blocks = 0;
  cudaGetDevice(&device);
  prepare_kernel(device);
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, decode_chunk, THREADS, DYNAMIC_SMEM) != cudaSuccess) return 1;
  return blocks > 0 ? blocks : 1;
}

void launch_decode(const DecodeParams& p, cudaStream_t stream) {
  if (p.num_chunks < 1 || p.num_chunks > {{ max_chunks }})
    throw std::runtime_error("jitattn decode: num_chunks out of range: " + std::to_string(p.num_chunks));
  int previous = -1;
  cudaGetDevice(&previous);
  if (previous != p.device) cudaSetDevice(p.device);
  prepare_kernel(p.device);
  // Both kernels are programmatic dependents: decode_chunk of whatever kernel precedes it on the
  // stream (a model's previous op; it waits before touching global memory), merge_chunks of
  // decode_chunk.
  launch_dependent(decode_chunk, dim3(p.num_chunks, p.num_kv_heads, p.num_group_tiles), THREADS, stream, p,
                   DYNAMIC_SMEM);
  if (p.num_chunks > 1) launch_dependent(merge_chunks, p.num_kv_heads * p.group_size, MERGE_THREADS, stream, p);
  const cudaError_t err = cudaGetLastError();
  if (previous != p.device) cudaSetDevice(previous);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("jitattn decode launch failed: ") + cudaGetErrorString(err));
}
