/**
 * The model picker: the models `GET /models` lists, offered only when the gateway serves
 * more than one. A one-model gateway's page stays as it was: no picker, and its runs
 * name no model (the gateway's default is the only one). The model picked is kept as the
 * tool is: in the URL's hash (`#TOOL&model=NAME`) and in localStorage.
 */
import type {ModelInfo} from '../generated/types.ts'
import {listModels} from '../models.ts'
import {h} from './dom.ts'

/** The page's localStorage, per gateway (main.ts). */
export interface Saved {
  get: (key: string) => string | null
  set: (key: string, value: string) => void
}

/** What the URL's hash asks for: `#TOOL`, or `#TOOL&model=NAME`. */
export function readHash(hash: string): {tool: string; model: string | undefined} {
  const [tool = '', ...rest] = hash.replace(/^#/, '').split('&')
  let name = tool
  try {
    name = decodeURIComponent(tool)
  } catch {
    // Not percent-encoding after all: the name as written.
  }
  return {tool: name, model: new URLSearchParams(rest.join('&')).get('model') ?? undefined}
}

/** The hash for `tool` on `model` (undefined: the only model, left out). */
export function writeHash(tool: string, model: string | undefined): string {
  return `#${tool}${model === undefined ? '' : `&${new URLSearchParams({model})}`}`
}

export class ModelPicker {
  /** The gateway's models, the default first; empty until `GET /models` answers (or when it cannot). */
  models: ModelInfo[] = []
  /** The model asked for: by the URL, or the last one picked here; a list that lacks it leaves the default picked. */
  private chosen: string

  constructor(
    private readonly base: URL,
    private readonly label: HTMLElement,
    private readonly select: HTMLSelectElement,
    saved: Saved,
    asked: string | undefined,
    onPick: () => void,
  ) {
    this.chosen = asked ?? saved.get('model') ?? ''
    select.addEventListener('change', () => {
      this.chosen = select.value
      saved.set('model', this.chosen)
      onPick()
    })
  }

  /** The model runs name and tools are listed for: the one picked; undefined while the gateway serves one (or says nothing). */
  get value(): string | undefined {
    return this.models.length > 1 ? this.select.value || undefined : undefined
  }

  /** The model asked for before `GET /models` answers: whose tools kept from the last visit to draw at once. */
  get asked(): string | undefined {
    return this.chosen || undefined
  }

  /** The picked model's entry, when there is a choice. */
  get picked(): ModelInfo | undefined {
    const name = this.value
    return name === undefined ? undefined : this.models.find((m) => m.name === name)
  }

  /** The tags (named prefixes) of the model runs go to: the picked one, else the only or default one. */
  get tags(): readonly string[] {
    const model = this.picked ?? this.models.find((m) => m.default) ?? this.models[0]
    return model?.tags ?? []
  }

  /** Ask `GET /models` (again, e.g. once the models have loaded and their kinds are known) and fill the picker. */
  async load(): Promise<void> {
    try {
      this.models = (await listModels(this.base)).models // the default first
    } catch {
      // A gateway that cannot list its models (or cannot be reached): runs go to its default, as before.
      this.models = []
    }
    const several = this.models.length > 1
    this.label.hidden = !several
    this.select.disabled = !several
    if (!several) return
    const names = this.models.map((m) => m.name)
    const fallback = this.models.find((m) => m.default)?.name ?? names[0]!
    const options = this.models.map((m) =>
      h('option', {value: m.name, title: m.problem ?? [m.device, m.dtype].filter(Boolean).join(' · ')}, optionText(m)),
    )
    this.select.replaceChildren(...options)
    this.select.value = names.includes(this.chosen) ? this.chosen : fallback
  }
}

/** The model's name with its kind (what tells a masked LM from a causal one), or why it cannot run yet. */
function optionText(model: ModelInfo): string {
  const what = model.ready ? model.kind : model.problem ? 'not ready' : 'loading'
  return [model.name, what].filter(Boolean).join(' · ')
}
