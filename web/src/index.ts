export {runAndStream, runTool, type RequestOptions, type ResumeInfo, type ResumeOptions, type RunOptions} from './run.ts'
export {listModels} from './models.ts'
export {JobTracker, parseEventId, type JobEvent, type JobState, type RawEvent} from './job.ts'
export {
  AbortError,
  HttpError,
  JobError,
  parseRetryAfter,
  ProtocolError,
  StreamEndedError,
  StreamgateError,
  TimeoutError,
  type JobSnapshot,
  type RunError,
} from './errors.ts'
export {EXAMPLES, SAE_EXAMPLES} from './examples.ts'
export type * from './generated/types.ts'
