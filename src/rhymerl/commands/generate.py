"""`rhymerl generate`: sample completions from a model, streamed, as text or as JSON lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rhymerl.commands.options import DEVICE_HELP, MODEL_HELP, DefaultsHelp, check_device, positive_int, setup
from rhymerl.engine.engine import Engine, StepEvent
from rhymerl.engine.sampling_params import SamplingParams
from rhymerl.errors import UserError
from rhymerl.model.capacity import check_context
from rhymerl.model.config import ModelConfig
from rhymerl.model.fetch import resolve_model_dir
from rhymerl.model.pretrained import DTYPES, chat_prompt_ids, load_pretrained, parse_dtype
from rhymerl.tasks.prompt_file import read_prompt_file


def encode(tokenizer, prompt, chat: bool) -> list[int]:
    """A prompt's token ids: plain text encoded as is without `chat`, else through the chat template (chat
    messages always)."""
    return tokenizer.encode(prompt) if isinstance(prompt, str) and not chat else chat_prompt_ids(tokenizer, prompt)


def cmd_generate(args) -> int:
    """Run `rhymerl generate`; 1 when every prompt failed, else 0."""
    # Every option and file is checked before the model loads: a mistake costs no waiting.
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, stop=tuple(args.stop), seed=args.seed)
    except ValueError as e:  # SamplingParams' range checks, naming the field
        raise UserError(f"generate: {e} (--temperature, --top-k, --top-p, --max-tokens, --stop)") from None
    setup(args)
    prompts = list(args.prompts) + ([row.prompt for row in read_prompt_file(Path(args.file))] if args.file else [])
    if not prompts:
        raise UserError("generate: no prompts (give them as arguments or with --file FILE.jsonl)")
    device = check_device(args.device)
    model_dir = resolve_model_dir(args.model)
    context = ModelConfig.from_dir(model_dir).max_position_embeddings
    max_model_len = args.max_model_len or min(2048, context)
    check_context(model_dir, max_model_len=max_model_len, num_slots=args.num_slots,
                  dtype=parse_dtype(args.dtype, device), device=device, key="--max-model-len", slots_key="--num-slots")
    model, tokenizer, model_dir = load_pretrained(str(model_dir), args.dtype, device)
    engine = Engine(model, tokenizer, num_slots=args.num_slots, max_model_len=max_model_len)
    ids = [encode(tokenizer, p, not args.no_chat_template) for p in prompts]
    shown: dict = {}

    def stream(ev: StepEvent) -> None:  # print each request's new text as it arrives
        if len(prompts) == 1:
            done = shown.get(ev.request_id, [])
            done += ev.new_token_ids
            text = tokenizer.decode(done, skip_special_tokens=True)
            sys.stdout.write(text[len(tokenizer.decode(done[: -len(ev.new_token_ids)], skip_special_tokens=True)):])
            sys.stdout.flush()
            shown[ev.request_id] = done
        elif ev.output is not None:
            print(f"[{ev.request_id}] {ev.output.text if ev.output.error is None else 'ERROR: ' + ev.output.error}", flush=True)

    outs = engine.generate(ids, params, request_ids=list(range(len(ids))), progress=not args.stream and len(ids) > 1,
                           on_event=stream if args.stream else None)
    for i, o in enumerate(outs):
        if args.json:
            print(json.dumps({"prompt": prompts[i], "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "error": o.error}))
        elif not args.stream:
            print(f"--- [{i}] {o.finish_reason}, {len(o.token_ids)} tokens")
            print(o.text if o.error is None else f"ERROR: {o.error}")
        elif o.error is not None and len(prompts) == 1:
            print(f"ERROR: {o.error}")
    s = engine.stats
    print(f"\n[{model_dir.name}] {s.generated_tokens} tokens in {s.busy_s:.2f} s "
          f"({s.generated_tokens / max(s.busy_s, 1e-9):.1f} tok/s, {s.forward_passes} forwards)", file=sys.stderr)
    return 1 if all(o.error for o in outs) else 0


def add_parser(sub) -> None:
    """`generate` and its options, on the top-level subparsers `sub`."""
    g = sub.add_parser("generate", help="sample completions from a model", formatter_class=DefaultsHelp)
    g.add_argument("prompts", nargs="*", help="prompt texts (the chat template is applied)")
    g.add_argument("--file", help="JSONL file with a 'prompt' field per row (text or chat messages)")
    g.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], metavar="DTYPE",
                   help="auto | bf16 | fp32 | fp16 (auto: bf16 where the device has native bf16 matmuls, else fp32)")
    g.add_argument("--device", default=None, help=DEVICE_HELP)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--max-tokens", type=int, default=256, help="max_completion_length")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=0, help="a token's draw depends on (seed, request, position) only")
    g.add_argument("--num-slots", type=positive_int, default=32, help="sequences decoded together")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="prompt + completion tokens per slot (default: 2048, or the model's context if shorter)")
    g.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="one JSON object per result")
    g.set_defaults(func=cmd_generate)
