/**
 * A tool's form, generated from its params JSON Schema (as `GET /tools` gives it).
 * The gateway stays the judge of what is valid: values are sent as typed as the
 * form can make them, and its 422 is shown on the field it names.
 */
import type {ToolInfo} from '../generated/types.ts'
import {h} from './dom.ts'
import {exactInteger, parseExact, stringifyExact} from './exact.ts'

type Schema = {[key: string]: unknown}
/**
 * `strings`: one item per line; `blocks`: one box per item (sequences, which may be pasted with
 * their line breaks), each sent as typed.
 */
type Kind = 'string' | 'text' | 'strings' | 'blocks' | 'numbers' | 'number' | 'bool' | 'enum' | 'json'

interface Field {
  name: string
  row: HTMLElement
  read: () => {value?: unknown}
  write: (value: unknown) => void
  error: HTMLElement
}

/** A value the form will not send as typed, and the field it is in. */
export class FieldError extends Error {
  constructor(
    readonly field: string,
    message: string,
  ) {
    super(message)
  }
}

export interface ToolForm {
  element: HTMLElement
  /**
   * The params to send; throws a FieldError for a value it cannot send exactly, and an
   * Error when the JSON view does not parse, for the caller to show.
   */
  read: () => Record<string, unknown>
  /** Mark the field named in an error (`prompts[3]` marks `prompts`), or the form as a whole. */
  showError: (field: string | undefined, message: string) => void
  clearErrors: () => void
  /** Leave these fields out: hidden, and not in what `read` gives; `json`: whether the JSON view may be used meanwhile. */
  omit: (names: string[], json: boolean) => void
}

const obj = (x: unknown): Schema => (x && typeof x === 'object' && !Array.isArray(x) ? (x as Schema) : {})

/** `$ref` into the schema's own `$defs`, with the referring node's own keywords (description, default) kept. */
function deref(node: Schema, root: Schema): Schema {
  const ref = node.$ref
  if (typeof ref !== 'string' || !ref.startsWith('#/$defs/')) return node
  const {$ref: _ref, ...rest} = node
  return {...deref(obj(obj(root.$defs)[ref.slice('#/$defs/'.length)]), root), ...rest}
}

/** The field's schema with `anyOf [X, null]` unwrapped: X, and whether null (leave empty) is allowed. */
function unwrap(node: Schema, root: Schema): {schema: Schema; nullable: boolean} {
  const resolved = deref(node, root)
  const alternatives = Array.isArray(resolved.anyOf) ? resolved.anyOf.map((a) => deref(obj(a), root)) : null
  if (!alternatives) return {schema: resolved, nullable: false}
  const real = alternatives.filter((a) => a.type !== 'null')
  const {anyOf: _anyOf, ...rest} = resolved
  const nullable = real.length < alternatives.length
  if (real.length === 1) return {schema: {...real[0], ...rest, description: rest.description ?? real[0]!.description}, nullable}
  return {schema: rest, nullable}
}

/** The schema of the tool's param `name` (or of `node`, a schema inside it), `$ref`s followed and `anyOf [X, null]` unwrapped. */
export function paramSchema(tool: ToolInfo, name: string, node?: unknown): Schema | undefined {
  const root = tool.params_schema as Schema
  const given = node ?? obj(root.properties)[name]
  return given && typeof given === 'object' ? unwrap(obj(given), root).schema : undefined
}

function kindOf(name: string, schema: Schema): Kind {
  if (Array.isArray(schema.enum)) return 'enum'
  const items = obj(schema.items)
  switch (schema.type) {
    case 'boolean':
      return 'bool'
    case 'integer':
    case 'number':
      return 'number'
    case 'string':
      return /prompt|text/.test(name) ? 'text' : 'string'
    case 'array':
      if (items.type === 'string') return /sequence/.test(name) ? 'blocks' : 'strings'
      if (items.type === 'integer' || items.type === 'number') return 'numbers'
      return 'json'
    default:
      return 'json'
  }
}

function rules(schema: Schema, kind: Kind): string {
  const out: string[] = []
  const items = obj(schema.items)
  const range = (lo: unknown, hi: unknown, exclusiveLo?: unknown) =>
    lo !== undefined || hi !== undefined || exclusiveLo !== undefined
      ? `${exclusiveLo !== undefined ? `> ${exclusiveLo}` : lo !== undefined ? `≥ ${lo}` : ''}${(lo ?? exclusiveLo) !== undefined && hi !== undefined ? ', ' : ''}${hi !== undefined ? `≤ ${hi}` : ''}`
      : ''
  if (kind === 'number') out.push(range(schema.minimum, schema.maximum, schema.exclusiveMinimum))
  if (kind === 'strings') out.push('one per line')
  if (kind === 'blocks') out.push('one box each, sent as typed, line breaks and all')
  if (kind === 'numbers') out.push('separated by commas or spaces')
  if (schema.type === 'array') out.push(range(schema.minItems, schema.maxItems) && `items ${range(schema.minItems, schema.maxItems)}`)
  if (kind === 'numbers') out.push(range(items.minimum, items.maximum))
  if (schema.default !== undefined && schema.default !== null) out.push(`default ${stringifyExact(schema.default)}`)
  return out.filter(Boolean).join('; ')
}

function field(name: string, node: Schema, root: Schema, required: boolean, initial: unknown): Field {
  const {schema, nullable} = unwrap(node, root)
  const kind = kindOf(name, schema)
  const id = `f-${name}`
  const optional = !required
  let input: HTMLInputElement | HTMLTextAreaElement | HTMLSelectElement
  const blocks = kind === 'blocks' ? itemBoxes(name, id) : undefined
  switch (kind) {
    case 'blocks':
      input = blocks!.first()
      break
    case 'text':
    case 'strings':
    case 'json':
      input = h('textarea', {id, name, rows: kind === 'json' ? 3 : 2, spellcheck: 'false'})
      break
    case 'bool':
      input = h('input', {id, name, type: 'checkbox'})
      break
    case 'enum':
      input = h(
        'select',
        {id, name},
        optional && schema.default === undefined ? h('option', {value: ''}, '(none)') : null,
        (schema.enum as unknown[]).map((v) => h('option', {value: String(v)}, String(v))),
      )
      break
    case 'number':
      input = h('input', {
        id,
        name,
        type: 'number',
        inputmode: schema.type === 'integer' ? 'numeric' : 'decimal',
        step: schema.type === 'integer' ? 1 : 'any',
      })
      break
    default:
      input = h('input', {id, name, type: 'text', autocomplete: 'off'})
  }

  const write = (value: unknown) => {
    if (input instanceof HTMLInputElement && input.type === 'checkbox') {
      input.checked = value === true
      return
    }
    if (blocks) blocks.write(Array.isArray(value) ? value.map(String) : value === undefined || value === null ? [] : [String(value)])
    else if (value === undefined || value === null) input.value = ''
    else if (kind === 'strings' && Array.isArray(value)) input.value = value.join('\n')
    else if (kind === 'numbers' && Array.isArray(value)) input.value = value.join(', ')
    else if (kind === 'json') input.value = stringifyExact(value)
    else input.value = String(value)
  }
  /**
   * A number as typed; for an integer, exactly: digits past 2^53 − 1 go as a bigint, and an
   * integer that large in another notation (1e20) is refused rather than rounded.
   */
  const number = (text: string, integer: boolean): unknown => {
    const exact = integer ? exactInteger(text) : undefined
    if (exact !== undefined) return exact
    const value = Number(text)
    if (Number.isNaN(value)) return text
    if (integer && Number.isInteger(value) && !Number.isSafeInteger(value)) {
      throw new FieldError(name, `${name}: write ${text.trim()} in plain digits, so that it is sent exactly`)
    }
    return value
  }
  const read = (): {value?: unknown} => {
    if (input instanceof HTMLInputElement && input.type === 'checkbox') return {value: input.checked}
    if (blocks) {
      // Each box as typed; only a box with nothing but blanks in it is left out.
      const items = blocks.read().filter((item) => item.trim() !== '')
      return items.length ? {value: items} : optional ? {} : {value: []}
    }
    const raw = input.value
    if (raw.trim() === '' && kind !== 'text' && kind !== 'string') return optional ? {} : kind === 'strings' || kind === 'numbers' ? {value: []} : {}
    switch (kind) {
      case 'text':
      case 'string':
        return raw === '' && optional ? {} : {value: raw}
      case 'strings':
        return {value: raw.split('\n').filter((line) => line !== '')}
      case 'numbers': {
        const integer = obj(schema.items).type === 'integer'
        return {value: raw.split(/[\s,]+/).filter(Boolean).map((t) => (/^[-+]?\d+(\.\d+)?$/.test(t) || integer ? number(t, integer) : t))}
      }
      case 'number':
        return {value: number(raw, schema.type === 'integer')}
      case 'enum':
        // The schema's own value (an integer enum's numbers too), not the option's text.
        return {value: (schema.enum as unknown[]).find((v) => String(v) === raw) ?? raw}
      default:
        try {
          return {value: parseExact(raw)}
        } catch {
          return {value: raw}
        }
    }
  }
  write(initial !== undefined ? initial : schema.default)

  const error = h('div', {class: 'field-error', role: 'alert', hidden: true})
  const help = [typeof schema.description === 'string' ? schema.description : '', rules(schema, kind), nullable && optional ? 'optional' : '']
    .filter(Boolean)
    .join(' · ')
  const row = h(
    'div',
    {class: `field field-${kind}`, 'data-field': name},
    h('label', {for: id}, name, required ? h('span', {class: 'required', title: 'required'}, ' *') : null),
    blocks ? blocks.element : input,
    help ? h('small', {class: 'help'}, help) : null,
    error,
  )
  return {name, row, read, write, error}
}

/**
 * A list of strings as one textarea per item, with buttons to add and remove one: for items long and
 * pasted (a sequence, in FASTA lines), whose line breaks belong to the item. The first box has `id`.
 */
function itemBoxes(name: string, id: string): {element: HTMLElement; first: () => HTMLTextAreaElement; read: () => string[]; write: (items: string[]) => void} {
  const list = h('ol', {class: 'blocks'})
  const boxes = () => [...list.querySelectorAll<HTMLTextAreaElement>('textarea')]
  const renumber = () =>
    boxes().forEach((box, i, all) => {
      box.id = i === 0 ? id : `${id}-${i}`
      box.setAttribute('aria-label', `${name} ${i + 1} of ${all.length}`)
      const remove = box.nextElementSibling as HTMLButtonElement
      remove.setAttribute('aria-label', `remove ${name} ${i + 1}`)
      remove.hidden = all.length === 1
    })
  const add = (value: string) => {
    const box = h('textarea', {name, rows: 3, spellcheck: 'false', autocomplete: 'off'})
    box.value = value
    const remove = h('button', {type: 'button', class: 'icon block-remove', title: `remove this ${name.replace(/s$/, '')}`}, '×')
    const item = h('li', {class: 'block'}, box, remove)
    remove.addEventListener('click', () => {
      item.remove()
      renumber()
      boxes()[0]?.focus()
    })
    list.appendChild(item)
    renumber()
    return box
  }
  const more = h('button', {type: 'button', class: 'block-add'}, `+ another ${name.replace(/s$/, '')}`)
  more.addEventListener('click', () => add('').focus())
  add('')
  return {
    element: h('div', {class: 'blocks-box'}, list, more),
    first: () => boxes()[0]!,
    read: () => boxes().map((box) => box.value),
    write: (items) => {
      list.replaceChildren()
      for (const item of items.length ? items : ['']) add(item)
    },
  }
}

/**
 * The param every tool takes for the model to run on (the gateway refuses a tool's own field of
 * that name): the model picker's, not a field of each form.
 */
const MODEL_PARAM = 'model'
/** The named prefix a tool of sequences takes: a choice among the model's tags, shown only when it has some. */
const TAG_PARAM = 'tag'

export function buildForm(tool: ToolInfo, initial: Record<string, unknown>, tags: readonly string[] = []): ToolForm {
  const root = tool.params_schema as Schema
  const required = new Set(Array.isArray(root.required) ? (root.required as string[]) : [])
  const fields = Object.entries(obj(root.properties))
    .filter(([name]) => name !== MODEL_PARAM && (name !== TAG_PARAM || tags.length > 0))
    .map(([name, node]) => {
      const schema = name === TAG_PARAM ? {...obj(node), anyOf: [{type: 'string', enum: [...tags]}, {type: 'null'}]} : obj(node)
      return field(name, schema, root, required.has(name), initial[name])
    })
  let omitted = new Set<string>()
  const fromFields = () => {
    const params: Record<string, unknown> = {}
    for (const f of fields) {
      if (omitted.has(f.name)) continue
      const {value} = f.read()
      if (value !== undefined) params[f.name] = value
    }
    return params
  }

  const json = h('textarea', {class: 'json-params', rows: 8, spellcheck: 'false', 'aria-label': 'params as JSON'})
  const jsonRow = h('div', {class: 'field', hidden: true}, json)
  const formError = h('div', {class: 'field-error', role: 'alert', hidden: true})
  const toggle = h('input', {type: 'checkbox', class: 'json-toggle'})
  toggle.addEventListener('change', () => {
    if (toggle.checked) {
      try {
        json.value = stringifyExact(fromFields(), 2)
      } catch (error) {
        toggle.checked = false
        showError(error instanceof FieldError ? error.field : undefined, (error as Error).message)
        return
      }
    } else {
      try {
        const params = obj(parseExact(json.value))
        for (const f of fields) f.write(params[f.name])
      } catch {
        // Leave the fields as they were.
      }
    }
    showFields()
  })
  const showFields = () => {
    jsonRow.hidden = !toggle.checked
    for (const f of fields) f.row.hidden = toggle.checked || omitted.has(f.name)
  }
  const jsonLabel = h('label', {class: 'inline muted'}, toggle, ' edit as JSON')

  function showError(path: string | undefined, message: string): void {
    const name = path?.split(/[.[]/)[0]
    const target = fields.find((f) => f.name === name)
    const slot = target && !toggle.checked ? target.error : formError
    slot.textContent = message
    slot.hidden = false
    target?.row.classList.add('invalid')
  }
  const clearErrors = () => {
    formError.hidden = true
    for (const f of fields) {
      f.error.hidden = true
      f.row.classList.remove('invalid')
    }
  }
  return {
    element: h('div', {class: 'fields'}, fields.map((f) => f.row), jsonRow, formError, jsonLabel),
    read: () => {
      if (!toggle.checked) return fromFields()
      try {
        return obj(parseExact(json.value))
      } catch (error) {
        throw new Error(`the params are not valid JSON: ${(error as Error).message}`)
      }
    },
    showError,
    clearErrors,
    omit: (names, json) => {
      if (!json && toggle.checked) {
        // Back to the fields, with what the JSON view held.
        toggle.checked = false
        toggle.dispatchEvent(new Event('change'))
      }
      omitted = new Set(names)
      jsonLabel.hidden = !json
      showFields()
    },
  }
}
