/** Debian's Chromium for the page tests, driven by playwright-core: found once, never downloaded. */
import {existsSync, mkdirSync} from 'node:fs'
import {join} from 'node:path'

import {chromium, type BrowserContext} from 'playwright-core'

import {WEB} from './gateway.ts'

export const CHROMIUM = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium'
export const ARTIFACTS = join(WEB, 'test-artifacts')
const found = existsSync(CHROMIUM)
if (!found && process.env.STREAMGATE_REQUIRE_BROWSER) {
  throw new Error(`no Chromium at ${CHROMIUM}: install Debian's \`chromium\` (apt-get install chromium) or set CHROMIUM_PATH`)
}

/** The `skip` of a suite that needs the browser (CI sets STREAMGATE_REQUIRE_BROWSER, so it never skips there). */
export const SKIP: string | false = found ? false : `no Chromium at ${CHROMIUM} (apt-get install chromium)`

/** A headless Chromium with its profile in `profile`; screenshots go to ARTIFACTS. */
export function launch(profile: string): Promise<BrowserContext> {
  mkdirSync(ARTIFACTS, {recursive: true})
  return chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-background-networking', '--disable-component-update'],
  })
}
