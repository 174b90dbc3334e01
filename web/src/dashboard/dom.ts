/** Building DOM without innerHTML: every string from the gateway or a model goes in as text. */

export type Child = Node | string | number | null | undefined | false | Child[]
type Attrs = Record<string, string | number | boolean | null | undefined | ((event: Event) => void)>

function fill(element: Element, attrs: Attrs | undefined, children: Child[]): void {
  for (const [key, value] of Object.entries(attrs ?? {})) {
    if (typeof value === 'function') element.addEventListener(key.slice(2), value)
    else if (value === true) element.setAttribute(key, '')
    else if (value !== false && value !== null && value !== undefined) element.setAttribute(key, String(value))
  }
  append(element, children)
}

export function append(parent: Node, children: Child[]): void {
  for (const child of children) {
    if (Array.isArray(child)) append(parent, child)
    else if (child instanceof Node) parent.appendChild(child)
    else if (child !== null && child !== undefined && child !== false) parent.appendChild(document.createTextNode(String(child)))
  }
}

/** An HTML element: `h('button', {class: 'x', onclick: () => …}, 'Run')`. */
export function h<K extends keyof HTMLElementTagNameMap>(tag: K, attrs?: Attrs, ...children: Child[]): HTMLElementTagNameMap[K] {
  const element = document.createElement(tag)
  fill(element, attrs, children)
  return element
}

/** An SVG element. */
export function svg<K extends keyof SVGElementTagNameMap>(tag: K, attrs?: Attrs, ...children: Child[]): SVGElementTagNameMap[K] {
  const element = document.createElementNS('http://www.w3.org/2000/svg', tag)
  fill(element, attrs, children)
  return element
}

/** A token as text a person can see: leading spaces as ␣, newlines as ⏎, tabs as ⇥. */
export function showToken(token: string): string {
  return token.replace(/^ +/, (spaces) => '␣'.repeat(spaces.length)).replaceAll('\n', '⏎').replaceAll('\t', '⇥') || '∅'
}

export function fmt(value: number, digits = 3): string {
  if (!Number.isFinite(value)) return String(value)
  if (Number.isInteger(value)) return String(value)
  const abs = Math.abs(value)
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(2)
  return value.toFixed(digits)
}

/** A position or a count as people read it: 12,345. */
export const pos = (p: number) => String(p).replace(/\B(?=(\d{3})+(?!\d))/g, ',')

export function percent(p: number): string {
  return p >= 0.1 ? `${(p * 100).toFixed(1)}%` : `${(p * 100).toFixed(2)}%`
}

/** A size in bytes as people read it: 512 B, 1.5 KiB, 15.7 MiB, 240 MiB (powers of 1024, as the gateway's limits are written). */
export function bytes(n: number): string {
  if (!(n >= 1024)) return `${n} B`
  const units = ['KiB', 'MiB', 'GiB', 'TiB']
  let value = n / 1024
  let unit = 0
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024
    unit++
  }
  return `${value.toFixed(value < 100 ? 1 : 0)} ${units[unit]}`
}
