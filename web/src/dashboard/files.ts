/** The files a job wrote beside its result (`files`: a per-position result too big for one event), as lists of links. */
import type {ResultFile} from '../generated/types.ts'
import {bytes, h} from './dom.ts'

/** The link to one of the job's files: jobs.ts makes it, with a ticket on a gateway with tokens. */
export type FileLink = (file: ResultFile) => HTMLElement

/** The files `result` names; none for a result that names none (or is not one of the gateway's). */
export function resultFiles(result: unknown): ResultFile[] {
  const files = result && typeof result === 'object' ? (result as {files?: unknown}).files : undefined
  return Array.isArray(files) ? files.filter((f): f is ResultFile => !!f && typeof f === 'object' && typeof (f as ResultFile).name === 'string') : []
}

/** Each file's link, format and size; without `link` (a view drawn outside a job card), its name alone. */
export function fileList(files: ResultFile[], link: FileLink | undefined): HTMLElement {
  return h(
    'ul',
    {class: 'file-list'},
    files.map((file) =>
      h(
        'li',
        {'data-file': file.name},
        link ? link(file) : h('code', {}, file.name),
        ' ',
        h('span', {class: 'muted file-meta'}, `${file.format}, ${bytes(file.size)}`),
      ),
    ),
  )
}
