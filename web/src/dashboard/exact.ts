/**
 * JSON whose integers keep every digit. `JSON.parse` reads an integer past 2^53 − 1 as the
 * nearest double (2^63 − 1 comes out as 9223372036854775808) and `JSON.stringify` cannot
 * write a bigint at all: the dashboard reads schemas and writes params through these two,
 * so a bound or default is shown as the gateway wrote it and a large value is sent as typed.
 */

const INTEGER = /^-?\d+$/

type Context = {source?: string}

let withSource: boolean | undefined
/** Whether this browser hands a reviver each value's source text (`JSON.parse` source text access). */
function sourceAccess(): boolean {
  if (withSource === undefined) {
    withSource = false
    JSON.parse('1', (_key: string, value: unknown, context?: Context) => {
      withSource = typeof context?.source === 'string'
      return value
    })
  }
  return withSource
}

/** A marker no string in `text` holds, to stand in for an integer the way through a string. */
function marker(text: string): string {
  for (;;) {
    const mark = `bigint:${Math.random().toString(36).slice(2)}:`
    if (!text.includes(mark)) return mark
  }
}

/** `text` with every integer literal that a double cannot hold (outside strings) quoted behind `mark`. */
function quoteLarge(text: string, mark: string): string {
  let out = ''
  let last = 0
  for (const match of text.matchAll(/"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g)) {
    const token = match[0]
    if (!INTEGER.test(token) || Number.isSafeInteger(Number(token))) continue
    out += `${text.slice(last, match.index)}"${mark}${token}"`
    last = match.index + token.length
  }
  return out + text.slice(last)
}

/** `JSON.parse`, with each integer beyond ±(2^53 − 1) read as a bigint of its exact digits. */
export function parseExact(text: string): unknown {
  if (sourceAccess()) {
    return JSON.parse(text, (_key: string, value: unknown, context?: Context) =>
      typeof value === 'number' && !Number.isSafeInteger(value) && context?.source && INTEGER.test(context.source) ? BigInt(context.source) : value,
    )
  }
  // Older browsers: the same from the raw text, the large integers carried through as marked strings.
  const mark = marker(text)
  return JSON.parse(quoteLarge(text, mark), (_key: string, value: unknown) =>
    typeof value === 'string' && value.startsWith(mark) ? BigInt(value.slice(mark.length)) : value,
  )
}

/** `JSON.stringify`, with bigints written as their digits (JSON has no limit on an integer's size). */
export function stringifyExact(value: unknown, space?: number): string {
  const mark = marker(JSON.stringify(value, (_key, v: unknown) => (typeof v === 'bigint' ? '' : v)) ?? '')
  const text = JSON.stringify(value, (_key, v: unknown) => (typeof v === 'bigint' ? `${mark}${v}` : v), space) ?? 'null'
  return text.replace(new RegExp(`"${mark}(-?\\d+)"`, 'g'), '$1')
}

/** An integer typed in plain digits, exactly: a number while it is safe, else a bigint; undefined for anything else. */
export function exactInteger(raw: string): number | bigint | undefined {
  const text = raw.trim()
  if (!/^[-+]?\d+$/.test(text)) return undefined
  const value = Number(text)
  return Number.isSafeInteger(value) ? value : BigInt(text)
}
