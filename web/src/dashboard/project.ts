/**
 * Vectors to 2-D by principal components: centre, then the top two directions of
 * variance by power iteration (XᵀX v, never forming the covariance), the second
 * deflated against the first. Returns each vector's coordinates and the share of
 * variance each axis explains.
 */
export function pca2(vectors: number[][]): {points: [number, number][]; explained: [number, number]} {
  const n = vectors.length
  const dim = vectors[0]?.length ?? 0
  if (n === 0 || dim === 0) return {points: [], explained: [0, 0]}
  const mean = new Float64Array(dim)
  for (const v of vectors) for (let j = 0; j < dim; j++) mean[j]! += v[j]! / n
  const X = vectors.map((v) => Float64Array.from(v, (x, j) => x - mean[j]!))
  const total = X.reduce((sum, row) => sum + row.reduce((s, x) => s + x * x, 0), 0)

  const dot = (a: Float64Array, b: Float64Array) => a.reduce((s, x, j) => s + x * b[j]!, 0)
  const times = (v: Float64Array): Float64Array => {
    // XᵀX v
    const out = new Float64Array(dim)
    for (const row of X) {
      const p = dot(row, v)
      for (let j = 0; j < dim; j++) out[j]! += p * row[j]!
    }
    return out
  }
  const normalise = (v: Float64Array) => {
    const norm = Math.sqrt(dot(v, v))
    return norm > 0 ? v.map((x) => x / norm) : v
  }
  const component = (avoid?: Float64Array): {axis: Float64Array; variance: number} => {
    // A fixed, deterministic start: the same input always gives the same picture.
    let v = normalise(Float64Array.from({length: dim}, (_, j) => 1 + ((j * 7919) % 13) / 13))
    let variance = 0
    for (let it = 0; it < 200; it++) {
      let w = times(v)
      if (avoid) {
        const p = dot(w, avoid)
        w = w.map((x, j) => x - p * avoid[j]!)
      }
      variance = Math.sqrt(dot(w, w))
      const next = normalise(w)
      const change = Math.abs(1 - Math.abs(dot(next, v)))
      v = next
      if (change < 1e-12) break
    }
    return {axis: v, variance}
  }
  const first = component()
  const second = component(first.axis)
  const points = X.map((row) => [dot(row, first.axis), dot(row, second.axis)] as [number, number])
  const share = (v: number) => (total > 0 ? v / total : 0)
  return {points, explained: [share(first.variance), share(second.variance)]}
}

/** Cosine similarity of every pair. */
export function cosines(vectors: number[][]): number[][] {
  const norms = vectors.map((v) => Math.sqrt(v.reduce((s, x) => s + x * x, 0)) || 1)
  return vectors.map((a, i) => vectors.map((b, j) => a.reduce((s, x, k) => s + x * b[k]!, 0) / (norms[i]! * norms[j]!)))
}
