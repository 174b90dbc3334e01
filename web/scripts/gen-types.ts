/**
 * Generates src/generated/types.ts from the gateway's JSON Schemas: each built-in
 * tool's params, result and partial (its `GET /tools` answer; the SAE tools, served
 * with `--sae`, apart as `SaeTools`), the protocol's frames, and the Structs of its other
 * answers that schemas.py lists beside them (`ToolInfo`, `ModelList` with `ModelInfo`,
 * `JobSnapshot`). `--check` fails instead of writing when the file on disk differs.
 *
 *   npm run gen:types            # write
 *   npm run gen:types -- --check # CI: the committed file must match
 */
import {execFileSync} from 'node:child_process'
import {readFileSync, writeFileSync} from 'node:fs'
import {dirname, join} from 'node:path'
import {fileURLToPath} from 'node:url'
import {compile, type JSONSchema} from 'json-schema-to-typescript'

type Schema = {title?: string; $defs?: Record<string, Schema>; [key: string]: unknown}
interface ToolInfo {
  name: string
  params_schema: Schema
  result_schema: Schema
  partial_schema: Schema | null
}

const here = dirname(fileURLToPath(import.meta.url))
const web = join(here, '..')
const out = join(web, 'src', 'generated', 'types.ts')
const python = process.env.STREAMGATE_PYTHON ?? join(web, '..', '.venv', 'bin', 'python')

const {tools, sae_tools: saeNames, frames} = tidy(JSON.parse(
  execFileSync(python, [join(here, 'schemas.py')], {encoding: 'utf8', maxBuffer: 64 << 20}),
)) as {tools: ToolInfo[]; sae_tools: string[]; frames: Record<string, Schema>}

/** One document holding every schema under `$defs` by title, and a root object that names them. */
function document(title: string, description: string, properties: Record<string, unknown>, schemas: Schema[]) {
  const defs: Record<string, Schema> = {}
  const add = (name: string, schema: Schema) => {
    const seen = defs[name]
    if (seen && JSON.stringify(seen) !== JSON.stringify(schema)) {
      throw new Error(`two different schemas are both called ${name}`)
    }
    defs[name] = schema
  }
  for (const schema of schemas) {
    const {$defs, ...top} = schema
    for (const [name, nested] of Object.entries($defs ?? {})) add(name, nested)
    if (!top.title) throw new Error(`a schema without a title: ${JSON.stringify(top).slice(0, 80)}`)
    add(top.title, top)
  }
  return {
    title,
    description,
    type: 'object',
    properties,
    required: Object.keys(properties),
    additionalProperties: false,
    $defs: defs,
  }
}

/**
 * Two rewrites that keep the generated names one per schema: a `$ref` with sibling keywords
 * (`{"$ref": "#/$defs/Stat", "default": "rank"}`) becomes an `allOf` of the bare reference, so it
 * is not declared again as `Stat1`; and a free-form object (`dict[str, Any]`) keeps its index
 * signature although `additionalProperties` defaults to false below.
 */
function tidy(node: unknown): unknown {
  if (Array.isArray(node)) return node.map(tidy)
  if (node === null || typeof node !== 'object') return node
  const entries = Object.entries(node).map(([k, v]) => [k, tidy(v)] as const)
  const obj: Record<string, unknown> = Object.fromEntries(entries)
  if (typeof obj.$ref === 'string' && Object.keys(obj).length > 1) {
    const {$ref, default: _default, ...rest} = obj
    return {...rest, allOf: [{$ref}]}
  }
  if (Array.isArray(obj.prefixItems) && obj.items === false) {
    // A tuple (msgspec writes 2020-12's prefixItems, which the compiler reads as nothing at all): as items.
    const {prefixItems, items: _items, ...rest} = obj
    return {...rest, items: prefixItems, additionalItems: false}
  }
  if (obj.type === 'object' && !('properties' in obj) && !('additionalProperties' in obj)) {
    return {...obj, additionalProperties: {}}
  }
  return obj
}

const ref = (schema: Schema | null) => (schema ? {$ref: `#/$defs/${schema.title}`} : {type: 'null'})

/** By tool name: its params, result and partial types (null: the tool streams none). */
const byName = (list: ToolInfo[]) =>
  Object.fromEntries(
    list.map((t) => [
      t.name,
      {
        type: 'object',
        properties: {params: ref(t.params_schema), result: ref(t.result_schema), partial: ref(t.partial_schema)},
        required: ['params', 'result', 'partial'],
        additionalProperties: false,
      },
    ]),
  )

// The SAE tools exist only on a gateway started with `--sae`: typed apart, as `SaeTools`.
const saeTools = tools.filter((t) => saeNames.includes(t.name))
const toolsDoc = document(
  'BuiltinTools',
  "Each built-in tool's params, result and partial (null: the tool streams none), by tool name.",
  byName(tools.filter((t) => !saeNames.includes(t.name))),
  [
    ...tools.flatMap((t) => [t.params_schema, t.result_schema, ...(t.partial_schema ? [t.partial_schema] : [])]),
    {
      title: 'SaeTools',
      description: "The SAE tools (served with `--sae`): each one's params, result and partial, by tool name.",
      type: 'object',
      properties: byName(saeTools),
      required: saeTools.map((t) => t.name),
      additionalProperties: false,
    },
  ],
)

const framesDoc = document(
  'Frames',
  'The data of each event type that has a fixed frame, by event name (`partial` and `data` are per tool).',
  {status: ref(frames.StatusFrame!), log: ref(frames.LogFrame!), error: ref(frames.ErrorFrame!)},
  Object.values(frames),
)

const options = {
  bannerComment: '',
  additionalProperties: false,
  ignoreMinAndMaxItems: true,
  strictIndexSignatures: true,
  unknownAny: true,
  unreachableDefinitions: true,
  style: {singleQuote: true, semi: false, printWidth: 110},
} as const

const banner = `/* Generated by scripts/gen-types.ts from the gateway's JSON Schemas (GET /tools and the
 * protocol's frames). Do not edit: run \`npm run gen:types\`. */

`
const text =
  banner +
  (await compile(framesDoc as unknown as JSONSchema, 'Frames', options)) +
  '\n' +
  (await compile(toolsDoc as unknown as JSONSchema, 'BuiltinTools', options))

if (process.argv.includes('--check')) {
  let current = ''
  try {
    current = readFileSync(out, 'utf8')
  } catch {}
  if (current !== text) {
    console.error(`${out} is out of date with the gateway's schemas: run \`npm run gen:types\` in web/`)
    process.exit(1)
  }
  console.log('src/generated/types.ts matches the gateway schemas')
} else {
  writeFileSync(out, text)
  console.log(`wrote ${out}`)
}
