// Packed query rows, shared by the forward and the backward: a CTA's rows are the query heads of
// one KV head's GQA group packed along M, row pr = token * pack + head in group (pr from the
// sequence's first token). Every (token, head) a kernel reads or writes comes from here.

struct TokenHead {
  int token;  // the query token (q_start + pr / pack)
  int head;   // the query head (kv_head * pack + pr % pack)
};

// Packed row pr (>= 0) of KV head kv_head of the sequence starting at query token q_start.
__device__ __forceinline__ TokenHead packed_row(int pr, int pack, int q_start, int kv_head) {
  const int r = pr / pack;
  return {q_start + r, kv_head * pack + (pr - r * pack)};
}

// Packed rows pr, pr + STEP, ... of a KV head's group, stepped by additions instead of a
// division per row (the forward's Q copies and O stores; why: notes/forward-h200.md, "PackedRow").
// pr may start below 0 (a causal block's head): token and head are then floored.
template <int STEP>
struct PackedRow {
  int pr, token, head;  // head: the head in the group, in [0, pack)
  int step_tokens, step_heads;
  __device__ __forceinline__ PackedRow(int pack, int q_start, int first_pr) : pr(first_pr) {
    const int t = (pr >= 0 ? pr : pr - pack + 1) / pack;
    token = q_start + t;
    head = pr - t * pack;
    step_tokens = STEP / pack;
    step_heads = STEP - step_tokens * pack;
  }
  __device__ __forceinline__ void advance(int pack) {
    pr += STEP;
    token += step_tokens;
    head += step_heads;
    if (head >= pack) {
      head -= pack;
      ++token;
    }
  }
};
