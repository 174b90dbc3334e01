/**
 * Chat mode, for a tool that takes `messages` (a conversation the model's chat template
 * renders) as well as `prompts`: each Send runs the tool on the conversation so far plus the
 * new message, streams the reply into an assistant bubble, and keeps it for the next turn.
 * The tool's other params stay in its form, which the conversation is read with.
 */
import type {ToolInfo} from '../generated/types.ts'
import {h} from './dom.ts'
import {FieldError, paramSchema, type ToolForm} from './form.ts'
import type {Failure, JobHooks} from './jobs.ts'

type Role = 'system' | 'user' | 'assistant'
interface Message {
  role: Role
  content: string
}

/** Starts a job of the chat's tool with `params`, the chat following it through `hooks`. */
export type Launch = (params: Record<string, unknown>, hooks: Omit<JobHooks, 'onRefused'> & Partial<Pick<JobHooks, 'onRefused'>>) => void

/** Whether the tool's params take a conversation: `messages`, a list of {role, content}. */
export function takesMessages(tool: ToolInfo): boolean {
  const schema = paramSchema(tool, 'messages')
  const item = schema?.type === 'array' ? paramSchema(tool, 'messages', schema.items) : undefined
  const props = item?.properties
  return !!props && typeof props === 'object' && 'role' in props && 'content' in props
}

/** The params that are the input: left out of the form while the conversation stands in for them. */
export const CHAT_INPUTS = ['prompts', 'messages']

let chats = 0

export class Chat {
  readonly element: HTMLElement
  private history: Message[] = []
  /** Bumped by Clear, so that a reply still streaming for a cleared conversation is dropped. */
  private conversation = 0
  private running = false
  private readonly system: HTMLTextAreaElement
  private readonly box: HTMLTextAreaElement
  private readonly log: HTMLOListElement
  private readonly empty: HTMLElement
  private readonly error: HTMLElement
  private readonly sendButton: HTMLButtonElement

  constructor(
    private readonly form: ToolForm,
    private readonly launch: Launch,
  ) {
    const id = `chat-${++chats}`
    this.system = h('textarea', {id: `${id}-system`, rows: 2, spellcheck: 'false', placeholder: 'optional: how the assistant should answer'})
    this.box = h('textarea', {id: `${id}-message`, class: 'chat-message', rows: 3, placeholder: 'Enter sends; Shift+Enter starts a new line'})
    this.log = h('ol', {class: 'chat-log', 'aria-label': 'conversation', 'aria-live': 'polite'})
    this.empty = h('p', {class: 'muted chat-empty'}, 'No messages yet: write one and press Send.')
    this.error = h('div', {class: 'error chat-error', role: 'alert', hidden: true})
    this.sendButton = h('button', {type: 'button', class: 'primary chat-send', onclick: () => this.send()}, 'Send')
    this.box.addEventListener('keydown', (event) => {
      if (event.key === 'Enter' && !event.shiftKey && !event.ctrlKey && !event.altKey && !event.metaKey && !event.isComposing) {
        event.preventDefault()
        this.send()
      }
    })
    this.element = h(
      'section',
      {class: 'chat', 'aria-label': 'chat'},
      h('div', {class: 'field'}, h('label', {for: this.system.id}, 'system'), this.system),
      this.log,
      this.empty,
      this.error,
      h('div', {class: 'field'}, h('label', {for: this.box.id}, 'message'), this.box),
      h(
        'div',
        {class: 'chat-actions'},
        this.sendButton,
        h('button', {type: 'button', class: 'chat-clear', onclick: () => this.clear()}, 'Clear conversation'),
      ),
    )
  }

  /** Send the message box's text as the next user turn. */
  send(): void {
    const text = this.box.value
    if (this.running) return
    this.form.clearErrors()
    this.error.hidden = true
    if (!text.trim()) {
      this.fail({code: 'empty', message: 'write a message first'})
      return
    }
    let params: Record<string, unknown>
    try {
      params = this.form.read()
    } catch (error) {
      this.form.showError(error instanceof FieldError ? error.field : undefined, (error as Error).message)
      return
    }
    for (const name of CHAT_INPUTS) delete params[name]
    const asked: Message = {role: 'user', content: text}
    const system = this.system.value.trim() ? [{role: 'system' as const, content: this.system.value}] : []
    params.messages = [...system, ...this.history, asked]

    const conversation = this.conversation
    const mine = () => conversation === this.conversation
    const question = this.bubble(asked)
    const reply = this.bubble({role: 'assistant', content: ''})
    const replyText = reply.querySelector<HTMLElement>('.bubble-text')!
    reply.classList.add('streaming')
    this.box.value = ''
    this.busy(true)
    const undo = () => {
      question.remove()
      reply.remove()
      this.empty.hidden = this.log.childElementCount > 0
      // The message goes back in the box to be sent again, unless something new was typed.
      if (!this.box.value) this.box.value = text
    }
    this.launch(params, {
      onPartial: (partial) => {
        const p = partial as {index?: unknown; text?: unknown}
        if (!mine() || p.index !== 0 || typeof p.text !== 'string') return
        replyText.append(p.text)
        this.follow()
      },
      onDone: (result) => {
        if (!mine()) return
        this.busy(false)
        const r = result as {completions?: unknown[]; finish_reasons?: unknown[]}
        const answer = String(r.completions?.[0] ?? '')
        replyText.textContent = answer
        reply.classList.remove('streaming')
        const finish = r.finish_reasons?.[0]
        if (typeof finish === 'string') reply.appendChild(h('span', {class: 'finish', title: 'finish reason'}, finish))
        this.history.push(asked, {role: 'assistant', content: answer})
        this.follow()
      },
      onFailed: (failure) => {
        if (!mine()) return
        this.busy(false)
        undo()
        this.fail(failure)
      },
      onRefused: (field, message) => {
        // The conversation stands in for the input fields: their errors are shown here (onFailed).
        if (mine() && field && !CHAT_INPUTS.includes(field.split(/[.[]/)[0]!)) this.form.showError(field, message)
      },
    })
  }

  /** Start again: no history (the system prompt stays); a reply still on its way is dropped. */
  clear(): void {
    this.conversation++
    this.history = []
    this.log.replaceChildren()
    this.empty.hidden = false
    this.error.hidden = true
    this.busy(false)
  }

  private bubble(message: Message): HTMLElement {
    const item = h('li', {class: `bubble ${message.role}`, 'data-role': message.role}, h('span', {class: 'bubble-text'}, message.content))
    this.log.appendChild(item)
    this.empty.hidden = true
    this.follow()
    return item
  }

  /** Keep the newest message in view. */
  private follow(): void {
    this.log.scrollTop = this.log.scrollHeight
  }

  private busy(running: boolean): void {
    this.running = running
    this.sendButton.disabled = running
    this.sendButton.textContent = running ? 'Replying…' : 'Send'
  }

  private fail(failure: Failure): void {
    this.error.replaceChildren(
      h('span', {class: 'code'}, failure.status ? `${failure.status} ${failure.code}` : failure.code),
      ' ',
      h('span', {class: 'message'}, failure.message),
      ...(failure.field ? [' ', h('span', {class: 'muted field-name'}, `(${failure.field})`)] : []),
    )
    this.error.hidden = false
  }
}
