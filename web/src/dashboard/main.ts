/** The dashboard: pick a tool, fill its generated form, run it, and watch each job stream. */
import {EXAMPLES, SAE_EXAMPLES} from '../examples.ts'
import type {Me, ModelInfo, ToolInfo} from '../generated/types.ts'
import {fmt, h} from './dom.ts'
import {Chat, CHAT_INPUTS, takesMessages} from './chat.ts'
import {parseExact, stringifyExact} from './exact.ts'
import {buildForm, FieldError, type ToolForm} from './form.ts'
import {startJob, type JobHooks} from './jobs.ts'
import {Login} from './login.ts'
import {ModelPicker, readHash, writeHash} from './models.ts'
import './style.css'

const base = new URL('.', location.href)
const $ = <T extends HTMLElement>(selector: string) => document.querySelector(selector) as T

/** `GET /readyz`, as the model line reads it (for a gateway of several models it describes the default). */
interface Ready {
  ready: boolean
  model?: string
  kind?: string
  capabilities?: string[]
  device?: string
  dtype?: string
  reason?: string
}

/**
 * The model line at the top: the picked model where there is a choice, else what `/readyz` says of
 * the one served, or what `GET /models` says of it where `/readyz` names none (a model on an
 * inference server); null: unreachable.
 */
function drawModelLine(body: Ready | null, picked: ModelInfo | undefined): void {
  const line = $<HTMLElement>('#model')
  if (!body) {
    line.textContent = 'the gateway cannot be reached'
    line.classList.add('warn')
    return
  }
  const facts = picked ? [picked.name, picked.kind, picked.device, picked.dtype] : [body.model, body.kind, body.device, body.dtype]
  line.textContent = body.ready ? facts.filter(Boolean).join(' · ') : `not ready: ${body.reason ?? ''}`
  line.title = !picked && body.capabilities?.length ? `capabilities: ${body.capabilities.join(', ')}` : ''
  line.classList.toggle('warn', !body.ready)
}

/**
 * Ask `/readyz` until the gateway is ready, drawing the model line with `draw`; `onReady` runs
 * when a gateway that was not ready (its models loading) becomes ready.
 */
async function readiness(draw: (body: Ready | null) => void, onReady: () => void, waited = false): Promise<void> {
  const again = (ms: number) => setTimeout(() => void readiness(draw, onReady, true), ms)
  try {
    const body = (await (await fetch(new URL('readyz', base))).json()) as Ready
    draw(body)
    if (!body.ready) again(2000)
    else if (waited) onReady()
  } catch {
    draw(null)
    again(5000)
  }
}

/** The tools the model cannot run, kept out of the picker: their names on one line, the gateway's reasons under it. */
function showUnsupported(box: HTMLDetailsElement, unsupported: ToolInfo[]): void {
  box.hidden = unsupported.length === 0
  box.replaceChildren(
    h('summary', {}, 'Not on this model: ', unsupported.map((t, i) => [i ? ', ' : '', h('code', {}, t.name)])),
    h('ul', {}, unsupported.map((t) => h('li', {'data-tool': t.name}, t.unsupported))),
  )
}

/** localStorage, where the browser lets the page use it; per gateway path, for gateways behind one origin. */
const saved = {
  get: (key: string): string | null => {
    try {
      return localStorage.getItem(`streamgate.${key}:${base.pathname}`)
    } catch {
      return null
    }
  },
  set: (key: string, value: string): void => {
    try {
      localStorage.setItem(`streamgate.${key}:${base.pathname}`, value)
    } catch {
      // Storage disabled or full: the next load waits for /tools, as a first visit does.
    }
  },
}

/** `GET /tools` (for `model`, or the only one) as text: parsed with every integer exact, and kept as it came for the next load. */
async function fetchTools(model: string | undefined): Promise<string> {
  const url = new URL('tools', base)
  if (model !== undefined) url.searchParams.set('model', model)
  const response = await fetch(url)
  if (!response.ok) throw new Error(`GET /tools answered ${response.status}`)
  return response.text()
}

/** Where a tool list is kept between visits: one per model picked. */
const toolsKey = (model: string | undefined) => (model === undefined ? 'tools' : `tools@${model}`)

/** A `GET /tools` answer, split: the tools the served model can run, and those it cannot (`unsupported` holds why). */
function splitTools(text: string): {runnable: ToolInfo[]; unsupported: ToolInfo[]} {
  const all = parseExact(text)
  if (!Array.isArray(all)) throw new Error('GET /tools did not answer a list')
  const tools = all as ToolInfo[]
  return {runnable: tools.filter((t) => !t.unsupported), unsupported: tools.filter((t) => t.unsupported)}
}

/** A tool's part of the page: its form, and for a tool that takes a conversation, the chat and the switch to it. */
interface ToolView {
  element: HTMLElement
  form: ToolForm
  schema: string
  chat?: Chat
  chatting: () => boolean
}

/**
 * Who the token in this tab is (`GET /me`): its name, class and priority, and what of its class's
 * quotas is used; nothing without a token, or on a gateway without tokens.
 */
async function drawMe(login: Login): Promise<void> {
  const line = $<HTMLElement>('#whoami')
  if (!login.token) {
    line.hidden = true
    return
  }
  try {
    const response = await fetch(new URL('me', base), {headers: login.headers(), cache: 'no-store'})
    if (!response.ok) throw new Error(String(response.status))
    const me = (await response.json()) as Me
    const quotas = (me.quotas ?? []).map(
      (q) => `${q.name.replaceAll('_', ' ')} ${fmt(q.used, 0)}/${fmt(q.limit, 0)}${q.held ? ` (+${fmt(q.held, 0)} held)` : ''}`,
    )
    const who = me.class ? `${me.name} · class ${me.class} (priority ${me.priority})` : `${me.name ?? me.tenant}`
    line.textContent = [who, ...quotas].join(' · ')
    line.hidden = false
  } catch {
    line.hidden = true
  }
}

async function main(): Promise<void> {
  const picker = $<HTMLSelectElement>('#tool')
  const unsupportedBox = $<HTMLDetailsElement>('#unsupported')
  const description = $<HTMLElement>('#description')
  const formSlot = $<HTMLElement>('#form')
  const jobs = $<HTMLElement>('#jobs')
  const form = $<HTMLFormElement>('#run')
  const runButton = form.querySelector<HTMLButtonElement>('button[type=submit]')!
  const toolsState = $<HTMLElement>('#tools-state')
  const formError = $<HTMLElement>('#form-error')
  const login = new Login(base, $<HTMLFormElement>('#login'))
  login.onToken = () => void drawMe(login)
  void drawMe(login)
  const asked = readHash(location.hash)
  /** The last `/readyz` answer: null when the gateway could not be reached, undefined before the first. */
  let ready: Ready | null | undefined
  const drawLine = () => ready !== undefined && drawModelLine(ready, models.picked ?? (ready?.model === undefined ? models.models[0] : undefined))
  const models = new ModelPicker(base, $<HTMLElement>('#model-picker'), $<HTMLSelectElement>('#model-select'), saved, asked.model, () => {
    drawLine()
    void list()
  })

  let tools: ToolInfo[] = []
  /** The tool asked for: by the URL, or the last one chosen here; a list that lacks it leaves it asked for. */
  let chosen = asked.tool || saved.get('tool') || ''
  const views = new Map<string, ToolView>()
  const current = (): ToolInfo | undefined => tools.find((t) => t.name === picker.value) ?? tools[0]

  /** Run `tool` with `params`: a new job card on top of the others. */
  const launch = (tool: ToolInfo, toolForm: ToolForm, given: Record<string, unknown>, hooks: Partial<JobHooks> = {}, reveal = true) => {
    // The picked model goes with the params (in the JSON of the GET the EventSource opens); a
    // `model` written in the JSON view is the user's own choice, and stays.
    const model = models.value
    const params = model === undefined || 'model' in given ? given : {...given, model}
    const card = startJob(base, login, tool, params, {
      onRefused: (field, message) => {
        if (current()?.name === tool.name) toolForm.showError(field, message)
      },
      ...hooks,
    })
    jobs.prepend(card)
    $<HTMLElement>('#empty').hidden = true
    // On a narrow screen the jobs are below the form: bring the new one into view.
    if (reveal && card.getBoundingClientRect().top > window.innerHeight) card.scrollIntoView({behavior: 'smooth', block: 'start'})
  }

  const viewOf = (tool: ToolInfo): ToolView => {
    const tags = models.tags
    // A model with tags gets the tag field: the same tool's form differs by model.
    const schema = stringifyExact(tool.params_schema) + (tags.length ? `\n${tags.join(',')}` : '')
    const kept = views.get(tool.name)
    if (kept?.schema === schema) return kept
    // The SAE tools' examples only matter when the gateway lists them (it serves an SAE).
    const examples = {...EXAMPLES, ...SAE_EXAMPLES} as unknown as Record<string, Record<string, unknown> | undefined>
    const toolForm = buildForm(tool, examples[tool.name] ?? {}, tags)
    let view: ToolView = {element: toolForm.element, form: toolForm, schema, chatting: () => false}
    if (takesMessages(tool)) {
      const chat = new Chat(toolForm, (params, hooks) => launch(tool, toolForm, params, hooks, false))
      const mode = (value: string, label: string) =>
        h('label', {}, h('input', {type: 'radio', name: `mode-${tool.name}`, value, checked: value === 'prompts'}), label)
      const modes = h('div', {class: 'modes', role: 'radiogroup', 'aria-label': 'input'}, mode('prompts', 'Prompts'), mode('chat', 'Chat'))
      const chatting = () => modes.querySelector<HTMLInputElement>('input[value=chat]')!.checked
      const sync = () => {
        for (const label of modes.querySelectorAll('label')) label.classList.toggle('on', label.querySelector('input')!.checked)
        chat.element.hidden = !chatting()
        toolForm.omit(chatting() ? CHAT_INPUTS : ['messages'], !chatting())
        runButton.hidden = chatting()
      }
      modes.addEventListener('change', sync)
      sync()
      view = {element: h('div', {class: 'tool-view'}, modes, chat.element, toolForm.element), form: toolForm, schema, chat, chatting}
    }
    views.set(tool.name, view)
    return view
  }

  const show = () => {
    const tool = current()
    runButton.disabled = !tool
    runButton.hidden = false
    if (!tool) {
      description.textContent = 'The served model can run none of the tools.'
      formSlot.replaceChildren()
      return
    }
    const view = viewOf(tool)
    description.textContent = tool.description
    // The same form again (a fresh /tools with its schema unchanged): left in place, so what is typed, and focus, stay.
    if (formSlot.firstElementChild !== view.element) {
      formSlot.replaceChildren(view.element)
      formError.hidden = true
    }
    runButton.hidden = view.chatting()
    const hash = writeHash(tool.name, models.value)
    if (location.hash !== hash) history.replaceState(null, '', hash)
  }
  /**
   * Fill the picker with the tools the model can run, showing the one chosen when it is one.
   * `from`: the last answer kept here, or the gateway's own.
   */
  const offer = (text: string, from: 'saved' | 'gateway', model: string | undefined) => {
    const {runnable, unsupported} = splitTools(text)
    tools = runnable
    const names = tools.map((t) => t.name)
    if ([...picker.options].map((o) => o.value).join() !== names.join()) picker.replaceChildren(...names.map((name) => h('option', {value: name}, name)))
    picker.disabled = false
    if (names.includes(chosen)) {
      picker.value = chosen
      saved.set('tool', chosen)
    }
    showUnsupported(unsupportedBox, unsupported)
    form.dataset.tools = from
    if (model === undefined) delete form.dataset.model
    else form.dataset.model = model
    toolsState.hidden = true
    show()
  }

  picker.addEventListener('change', () => {
    chosen = picker.value
    saved.set('tool', chosen)
    show()
  })

  form.addEventListener('submit', (event) => {
    event.preventDefault()
    const tool = current()
    if (!tool) return
    const view = viewOf(tool)
    if (view.chat && view.chatting()) {
      view.chat.send()
      return
    }
    const toolForm = view.form
    toolForm.clearErrors()
    formError.hidden = true
    let params: Record<string, unknown>
    try {
      params = toolForm.read()
    } catch (error) {
      toolForm.showError(error instanceof FieldError ? error.field : undefined, (error as Error).message)
      return
    }
    launch(tool, toolForm, params)
  })

  // The last answer kept here (for the model asked for) draws the form at once; the gateway's own answer replaces it when it comes.
  const kept = saved.get(toolsKey(models.asked))
  if (kept) {
    try {
      offer(kept, 'saved', undefined)
    } catch {
      // Not a list of tools after all: wait for the gateway's.
    }
  }
  /** Bumped by each listing, so that only the answer for the model picked last is drawn. */
  let listing = 0
  const list = async () => {
    const model = models.value
    const mine = ++listing
    if (form.dataset.tools === 'gateway' && form.dataset.model !== model) {
      // Another model picked: its tools are on their way.
      form.dataset.tools = 'loading'
      toolsState.textContent = 'loading tools…'
      toolsState.hidden = false
      runButton.disabled = true // until the form is the new model's
    }
    try {
      const text = await fetchTools(model)
      if (mine !== listing) return
      offer(text, 'gateway', model)
      saved.set(toolsKey(model), text)
    } catch (error) {
      if (mine !== listing) return
      formError.textContent = `could not list the tools: ${(error as Error).message}`
      formError.hidden = false
      toolsState.hidden = true
    }
  }
  // While a local model loads, the gateway cannot yet say what it cannot run, nor the models' kinds
  // (nor while it cannot be reached): list the models and tools again once it is ready.
  void readiness(
    (body) => {
      ready = body
      drawLine()
    },
    () => void models.load().then(list),
  )
  await models.load()
  drawLine()
  await list()
}

void main()
