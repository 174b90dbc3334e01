/**
 * Logging in to a gateway that has client tokens, without the token ever going in a URL.
 *
 * Nothing is asked until the gateway asks: a run answered 401 shows the token field
 * (`#login`), which takes a static token or a JWT of the gateway's identity provider,
 * and the token is kept in sessionStorage (this tab only, gone when it closes). With a token, each `EventSource` gets a ticket of its own from
 * `POST /auth/ticket` (the token in the `Authorization` header) and carries only that
 * short-lived ticket in its URL; every other request sends the header. A gateway
 * without tokens answers that POST 404: from then on no ticket is asked, as before.
 */
import {HttpError} from '../errors.ts'

const KEY = 'streamgate.token'

export class Login {
  /** The gateway answered 404 to `POST /auth/ticket`: it has no tokens. */
  private open = false
  /** Where the token lives when sessionStorage cannot be used (storage disabled). */
  private memory: string | undefined
  private waiting: {promise: Promise<void>; resolve: () => void} | undefined
  private readonly input: HTMLInputElement
  private readonly error: HTMLElement
  /** Called once a token is given (`main.ts` then says who it is, from `GET /me`). */
  onToken: () => void = () => {}

  constructor(
    private readonly base: URL,
    private readonly form: HTMLFormElement,
  ) {
    this.input = form.querySelector('input')!
    this.error = form.querySelector('.field-error')!
    form.addEventListener('submit', (event) => {
      event.preventDefault()
      const token = this.input.value.trim()
      if (!token) return
      this.input.value = ''
      this.store(token)
      this.open = false
      form.hidden = true
      this.waiting?.resolve()
      this.waiting = undefined
      this.onToken()
    })
  }

  /** The token given in this tab, if any. */
  get token(): string | undefined {
    try {
      return sessionStorage.getItem(KEY) ?? undefined
    } catch {
      return this.memory
    }
  }

  /** `Authorization: Bearer …` once there is a token; nothing before. */
  headers(): Record<string, string> {
    const token = this.token
    return token ? {Authorization: `Bearer ${token}`} : {}
  }

  /**
   * A fresh ticket for one GET stream, or undefined where none is needed: no token given yet
   * (the stream is tried as it is, and a 401 brings the token field), or no tokens on the gateway.
   */
  async ticket(): Promise<string | undefined> {
    for (;;) {
      const token = this.token
      if (!token || this.open) return undefined
      const response = await fetch(new URL('auth/ticket', this.base), {method: 'POST', headers: this.headers(), cache: 'no-store'})
      if (response.status === 404) {
        this.open = true
        return undefined
      }
      if (response.status === 401) {
        await this.refused(token)
        continue
      }
      if (!response.ok) throw await HttpError.fromResponse(response)
      return ((await response.json()) as {ticket: string}).ticket
    }
  }

  /**
   * The gateway answered 401 to a request sent with `token` (undefined: with none): forget that
   * token, show the token field and resolve once another is given. A token given meanwhile (by
   * another job's prompt) resolves at once.
   */
  refused(token: string | undefined): Promise<void> {
    if (this.waiting) return this.waiting.promise
    const current = this.token
    if (current !== undefined && current !== token) return Promise.resolve()
    this.store(undefined)
    this.open = false
    this.error.textContent = token ? 'The gateway refused that token: give another.' : ''
    this.error.hidden = !token
    this.form.hidden = false
    this.input.focus()
    let resolve = () => {}
    const promise = new Promise<void>((r) => (resolve = r))
    this.waiting = {promise, resolve}
    return promise
  }

  private store(token: string | undefined): void {
    this.memory = token
    try {
      if (token === undefined) sessionStorage.removeItem(KEY)
      else sessionStorage.setItem(KEY, token)
    } catch {
      // sessionStorage is off: the token lives in this page only.
    }
  }
}
