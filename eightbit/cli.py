"""The `eightbit` command: generate here; quantize, eval, bench and serve from their own packages."""

import argparse
import sys


def add_engine_args(parser):
    """Engine options shared by every subcommand that loads a model."""
    parser.add_argument("--model", default=None, help="HF checkpoint dir, GGUF file or int8 checkpoint "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="activations and the weights kept in float (default: bfloat16)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most tokens of a prompt and its output together (default: the model's context)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                        help="auto: the KV cache in --dtype; int8: group-quantized int8 (default: auto)")
    parser.add_argument("--kv-group-size", type=int, default=None,
                        help="int8 KV cache: values per scale (default: the int8 checkpoint's, else 32)")
    parser.add_argument("--quantization", default=None, choices=["w8a8"],
                        help="quantize a float checkpoint's linears on load (round-to-nearest, no smoothing)")


def engine_options(args) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                kv_cache_dtype=args.kv_cache_dtype, kv_group_size=args.kv_group_size,
                quantization=args.quantization)


def add_generate_parser(subparsers):
    p = subparsers.add_parser("generate", help="generate text from prompts, streaming it")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 picks the likeliest token (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens that hold this much probability (default: 1, all)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: the engine's seed, 0, so a sampled run repeats itself)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from eightbit import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    if any(not p for p in args.prompts):  # refused before the model loads; with --chat the template is never empty
        raise ValueError("a prompt is empty")
    llm = LLM(args.model, **engine_options(args))
    prompts = args.prompts
    if args.chat:
        from eightbit.engine.chat import render_chat

        prompts = [render_chat(llm.get_tokenizer(), [{"role": "user", "content": p}])[1] for p in prompts]
    for prompt in prompts:  # every prompt checked before the first one runs
        llm.engine.check_request(prompt, params)
    for i, prompt in enumerate(prompts):  # one prompt at a time, so its text streams in order
        if len(prompts) > 1:
            print(f"--- [{i}] {args.prompts[i]}", flush=True)
        for _, out in llm.stream(prompt, params):
            print(out.outputs[0].delta, end="", flush=True)
        print(flush=True)
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="eightbit", description="int8 LLM inference: generate, quantize, eval, bench, serve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    from eightbit.engine.server.cli import add_serve_parser
    from eightbit.eval.bench_cli import add_bench_parser
    from eightbit.eval.cli import add_eval_parser
    from eightbit.quant.cli import add_quantize_parser

    add_quantize_parser(sub)
    add_eval_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what the results record as their command, however the entry point was reached
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"eightbit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: a line, not a traceback, and the shell's code for SIGINT
        # the interrupt's own note (quant.writer.InterruptedAfterMove), else the command's: a string or a function
        note = getattr(e, "note", None) or getattr(args, "interrupt_note", None)
        if callable(note):
            note = note(args)
        print(f"\neightbit {args.command}: interrupted" + (f"; {note}" if note else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
