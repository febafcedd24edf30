r"""Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions).

  python -m kvjax.serve                              # SmolLM2 on 127.0.0.1:8000, SnapKV 512
  python -m kvjax.serve --model=model.gguf --policy=snapkv --budget=512 --kv_memory=4GiB \
      --max_slots=16 --max_prompt_tokens=8192 --max_tokens=512 --port=8000
  python -m kvjax.serve --policy=full --num_pages=20000 --mesh=model:2

Every request runs under one policy and budget; the pool of KV pages (--kv_memory
bytes, or --num_pages) is shared by --max_slots running requests. Any OpenAI
client talks to it:

  openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").completions.create(
      model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=32)

Also GET /v1/models, /health and /metrics (Prometheus). SIGTERM or Ctrl-C
stops taking connections, lets the open requests finish, then exits.
"""

from __future__ import annotations

from absl import flags

from kvjax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m-instruct",
                    "Registry name, .gguf path or safetensors folder.")
flags.DEFINE_bool("packed", False, "Keep a GGUF model's Q4_1 / Q8_0 matrices as their blocks "
                  "(see kvjax.load).")
flags.DEFINE_string("served_model_name", "", "The model's name in the API (what requests "
                    "name as `model`); empty: --model.")
flags.DEFINE_string("policy", "snapkv", "The KV-cache policy of every request "
                    "(kvjax.policies.names()).")
flags.DEFINE_integer("budget", 512, "KV entries kept per (layer, KV head); 0 for 'full'.")
flags.DEFINE_string("kv_memory", "1GiB", "The page pool's size in bytes, e.g. 4GiB, 512MiB.")
flags.DEFINE_integer("num_pages", 0, "The page pool's size in pages, instead of --kv_memory.")
flags.DEFINE_integer("max_slots", 8, "Requests running at once.")
flags.DEFINE_integer("max_prompt_tokens", 4096, "The longest prompt a request may send.")
flags.DEFINE_integer("max_tokens", 256, "The most tokens a request may generate (and the "
                     "default of a request that does not say).")
flags.DEFINE_integer("prefill_chunk", 512, "Prompt tokens per prefill chunk (policies that "
                     "compress in chunks).")
flags.DEFINE_integer("prefill_per_step", 2048, "Prompt tokens prefilled between two decode "
                     "dispatches (running requests keep generating while a long prompt comes in).")
flags.DEFINE_integer("page_size", 16, "Slots per cache page.")
flags.DEFINE_integer("steps_per_dispatch", 8, "Decode steps per dispatch.")
flags.DEFINE_enum("backend", "auto", ["auto", "xla", "pallas", "native"], "Kernel backend.")
flags.DEFINE_string("mesh", "", "A device mesh, e.g. model:2 or data:2,model:4: slots over "
                    "data, KV heads over model (docs/serving.md); empty: one device.")
flags.DEFINE_string("host", "127.0.0.1", "The address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "The port to listen on.")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"],
                  "The server's log level (uvicorn's).")

# What --help lists, by group.
HELP_GROUPS = (
    ("model", ("model", "packed", "served_model_name")),
    ("engine", ("policy", "budget", "kv_memory", "num_pages", "max_slots", "max_prompt_tokens",
                "max_tokens", "prefill_chunk", "prefill_per_step", "page_size",
                "steps_per_dispatch", "backend", "mesh")),
    ("server", ("host", "port", "log_level")),
)
UsageError = cli.UsageError


def _pool() -> dict:
  """The pool's size: --num_pages when given, else --kv_memory (checked before any work)."""
  from kvjax.serve.requests import parse_bytes
  if FLAGS.num_pages:
    if FLAGS["kv_memory"].present:
      raise UsageError("give the pool's size as one of --kv_memory and --num_pages")
    if FLAGS.num_pages < 0:
      raise UsageError(f"--num_pages must be positive, got {FLAGS.num_pages}")
    return {"num_pages": FLAGS.num_pages}
  try:
    parse_bytes(FLAGS.kv_memory)
  except ValueError as e:
    raise UsageError(f"--{e}") from None
  return {"kv_memory": FLAGS.kv_memory}


def _check_flags() -> None:
  """The flags a user may get wrong, refused in one line before the model loads."""
  from kvjax import policies
  if not 0 <= FLAGS.port <= 65535:
    raise UsageError(f"--port must be in [0, 65535], got {FLAGS.port}")
  if FLAGS.budget < 0:
    raise UsageError(f"--budget must be >= 0 (0 for 'full'), got {FLAGS.budget}")
  for name in ("max_slots", "max_prompt_tokens", "max_tokens", "page_size",
               "steps_per_dispatch", "prefill_chunk", "prefill_per_step"):
    if getattr(FLAGS, name) < 1:
      raise UsageError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
  if FLAGS.policy not in policies.names():
    raise UsageError(f"--policy {FLAGS.policy!r} is not one of {', '.join(policies.names())}")
  cli.check_backend(FLAGS.backend)


def _mesh() -> dict:
  """``mesh=`` for the engine when --mesh is given (a shape the devices cannot form: exit 2)."""
  if not FLAGS.mesh:
    return {}
  from kvjax import sharding
  try:
    return {"mesh": sharding.make_mesh(FLAGS.mesh)}
  except ValueError as e:
    raise UsageError(f"--mesh {FLAGS.mesh}: {e}") from None


def main(argv) -> None:
  if len(argv) > 1:
    cli.fail(f"unexpected arguments {argv[1:]}")
  cli.quiet_logs()
  _check_flags()
  pool, mesh = _pool(), _mesh()
  import uvicorn

  import kvjax
  from kvjax.serve import Engine, server
  # A bad model, a budget the policy cannot honour, a pool too small for one request:
  # ValueErrors, one line and exit 2 (cli.call).
  lm = kvjax.load(FLAGS.model, packed=FLAGS.packed)
  engine = Engine(
      lm, policy=FLAGS.policy, budget=FLAGS.budget or None, **pool, **mesh,
      max_slots=FLAGS.max_slots, max_prompt_tokens=FLAGS.max_prompt_tokens,
      max_tokens=FLAGS.max_tokens, prefill_chunk=FLAGS.prefill_chunk,
      prefill_per_step=FLAGS.prefill_per_step, page_size=FLAGS.page_size,
      steps_per_dispatch=FLAGS.steps_per_dispatch, backend=FLAGS.backend)
  app = server.create_app(server.EngineLoop(engine),
                          model_name=FLAGS.served_model_name or FLAGS.model)
  # uvicorn answers SIGTERM and Ctrl-C: it closes the socket, waits for the open
  # requests, then runs the app's lifespan shutdown, which drains the engine.
  uvicorn.Server(uvicorn.Config(app, host=FLAGS.host, port=FLAGS.port,
                                log_level=FLAGS.log_level)).run()


def run() -> None:
  """Entry point (``python -m kvjax.serve``)."""
  cli.run(main, HELP_GROUPS)


if __name__ == "__main__":
  run()
