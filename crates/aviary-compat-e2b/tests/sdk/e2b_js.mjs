// The official E2B JS SDK (npm `e2b`), unmodified, against Aviary.
// Env: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, RUN, E2B_JS_MODULE (the
// installed package's ESM entry). Prints one JSON object of observations
// last; kills what it creates.
const { Sandbox, CommandExitError } = await import(process.env.E2B_JS_MODULE)

const obs = {}
const sbx = await Sandbox.create({ metadata: { suite: 'js', run: process.env.RUN }, envs: { LANG_OF: 'js' } })
try {
  obs.sandboxId = sbx.sandboxId
  const chunks = []
  const r = await sbx.commands.run(
    'echo line1; for i in $(seq 300); do [ -e /tmp/go ] && break; sleep 0.1; done; ' +
      '[ -e /tmp/go ] && echo saw-go || echo no-go; echo $LANG_OF >&2',
    {
      onStdout: async (d) => {
        chunks.push(d)
        if (d.includes('line1')) await sbx.files.write('/tmp/go', 'go')
      },
    },
  )
  obs.chunks = chunks
  obs.stdout = r.stdout
  obs.stderr = r.stderr
  try {
    await sbx.commands.run('exit 3')
    obs.exit3 = 'no error'
  } catch (e) {
    obs.exit3 = e instanceof CommandExitError ? e.exitCode : String(e)
  }
  await sbx.files.write('/tmp/js/a.txt', 'from js')
  obs.read = await sbx.files.read('/tmp/js/a.txt')
  obs.list = (await sbx.files.list('/tmp/js')).map((e) => [e.name, e.type])
  obs.wc = (await sbx.commands.run('wc -c < /tmp/js/a.txt')).stdout.trim()
  obs.info = (await sbx.getInfo()).metadata
  const listed = async (query) => {
    const ids = []
    const paginator = Sandbox.list({ query, limit: 1 })
    while (paginator.hasNext) ids.push(...(await paginator.nextItems()).map((s) => s.sandboxId))
    return ids
  }
  obs.listRun = await listed({ metadata: { run: process.env.RUN, suite: 'js' } })
  obs.listOtherRun = await listed({ metadata: { run: 'other-' + process.env.RUN } })
  obs.pause = await sbx.pause()
  obs.runningPaused = await sbx.isRunning()
  obs.listPaused = await listed({ metadata: { run: process.env.RUN }, state: ['paused'] })
  const back = await Sandbox.connect(sbx.sandboxId)
  obs.runningBack = await back.isRunning()
  obs.readBack = await back.files.read('/tmp/js/a.txt')
  obs.kill = await sbx.kill()
  obs.running = await sbx.isRunning()
} finally {
  await Sandbox.kill(sbx.sandboxId)
}
console.log(JSON.stringify(obs))
