/** WCAG 2.x contrast of CSS colours as the browser computes them (`rgb(…)`/`rgba(…)`), written apart from the page's own. */

/** [r, g, b] of a computed colour; fails on anything else (a test must know what it compares). */
export function rgb(css: string): [number, number, number] {
  const match = /^rgba?\((\d+(?:\.\d+)?)[, ]+(\d+(?:\.\d+)?)[, ]+(\d+(?:\.\d+)?)(?:[,/ ]+([\d.]+))?\)$/.exec(css.trim())
  if (!match) throw new Error(`not an rgb() colour: ${css}`)
  if (match[4] !== undefined && Number(match[4]) !== 1) throw new Error(`a colour that is not opaque: ${css}`)
  return [Number(match[1]), Number(match[2]), Number(match[3])]
}

/** Relative luminance, per WCAG 2.x: each sRGB channel linearised, then weighted. */
export function luminance(css: string): number {
  const [r, g, b] = rgb(css).map((v) => {
    const c = v / 255
    return c <= 0.04045 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4)
  }) as [number, number, number]
  return 0.2126 * r + 0.7152 * g + 0.0722 * b
}

/** (lighter + 0.05) / (darker + 0.05): 1 to 21; WCAG AA asks 4.5 of normal text. */
export function contrastRatio(a: string, b: string): number {
  const [la, lb] = [luminance(a), luminance(b)]
  return (Math.max(la, lb) + 0.05) / (Math.min(la, lb) + 0.05)
}
