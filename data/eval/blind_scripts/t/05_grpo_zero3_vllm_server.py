"""
GRPO on DeepScaleR math problems with a DeepSpeed ZeRO-3 policy and rollouts
served by an external vLLM server (TRL's `trl vllm-serve`) on the last GPU.
Rank 0 collects every rank's prompts, asks the server for `group_size`
samples per prompt, and hands each rank back its own groups. After every
optimizer step the new weights are pushed to the server over NCCL.

    # GPU 7: generation server
    CUDA_VISIBLE_DEVICES=7 trl vllm-serve --model Qwen/Qwen2.5-Math-1.5B --port 8000 &
    # GPUs 0-6: training
    deepspeed --include localhost:0,1,2,3,4,5,6 05_grpo_zero3_vllm_server.py \
        --model Qwen/Qwen2.5-Math-1.5B --output_dir runs/grpo_dsr
"""
import argparse
import os
import re
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.extras.vllm_client import VLLMClient

BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-Math-1.5B")
    p.add_argument("--output_dir", default="runs/grpo_dsr")
    p.add_argument("--vllm_host", default="127.0.0.1")
    p.add_argument("--vllm_port", type=int, default=8000)
    p.add_argument("--prompts_per_rank", type=int, default=4)
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--clip_eps", type=float, default=0.2)
    p.add_argument("--max_steps", type=int, default=500)
    p.add_argument("--save_every", type=int, default=100)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def normalize(ans):
    ans = ans.strip().replace(" ", "").replace("\\!", "").rstrip(".")
    ans = ans.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("^\\circ", "")
    return ans


def score(completion, answer):
    m = BOXED.findall(completion)
    if not m:
        return 0.0
    return 1.0 if normalize(m[-1]) == normalize(answer) else 0.0


def build_ds_config(args, world):
    accum = args.prompts_per_rank * args.group_size // args.micro_batch
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": accum,
        "train_batch_size": args.micro_batch * accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.99], "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 10_000,
    }


def completion_logps(model, ids, attn, comp_mask):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.gather(logits.log_softmax(-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp * comp_mask[:, 1:]


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    G = args.group_size

    tok = AutoTokenizer.from_pretrained(args.model)
    ds_config = build_ds_config(args, world)

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=ds_config)

    ref_engine = None
    if args.beta > 0:
        ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
        ref_cfg = {k: v for k, v in ds_config.items() if k != "optimizer"}
        ref_engine, *_ = deepspeed.initialize(model=ref, config=ref_cfg)
        ref_engine.eval()

    client = None
    if rank == 0:
        client = VLLMClient(host=args.vllm_host, server_port=args.vllm_port, connection_timeout=600)
        client.init_communicator()
    dist.barrier()

    ds = load_dataset("agentica-org/DeepScaleR-Preview-Dataset", split="train")

    def fmt(ex):
        msgs = [{"role": "user", "content": ex["problem"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."}]
        return {"prompt": tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                "answer": ex["answer"]}

    ds = ds.map(fmt, remove_columns=ds.column_names)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler,
                        collate_fn=lambda b: ([x["prompt"] for x in b], [x["answer"] for x in b]))

    step, epoch = 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for prompts, answers in loader:
            t0 = time.time()
            # ---- generation on the server, driven by rank 0 ----
            all_prompts = [None] * world
            dist.all_gather_object(all_prompts, prompts)
            payload = [None]
            if rank == 0:
                flat = [p for ps in all_prompts for p in ps]
                payload[0] = client.generate(flat, n=G, temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens)
            dist.broadcast_object_list(payload, src=0)
            per_rank = len(prompts) * G
            comp_ids = payload[0][rank * per_rank:(rank + 1) * per_rank]

            texts = tok.batch_decode(comp_ids, skip_special_tokens=True)
            rewards = torch.tensor([score(t, answers[i // G]) for i, t in enumerate(texts)], device=dev)
            grp = rewards.view(-1, G)
            adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-4)).view(-1)

            prompt_ids = tok(prompts, add_special_tokens=False).input_ids
            rows = [prompt_ids[i // G] + list(c) for i, c in enumerate(comp_ids)]
            L = max(len(r) for r in rows)
            ids = torch.full((len(rows), L), tok.pad_token_id, dtype=torch.long, device=dev)
            attn = torch.zeros_like(ids)
            cmask = torch.zeros(len(rows), L, device=dev)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r, device=dev)
                attn[i, :len(r)] = 1
                cmask[i, len(prompt_ids[i // G]):len(r)] = 1.0

            # ---- policy update ----
            engine.train()
            losses = []
            for s in range(0, len(rows), args.micro_batch):
                sl = slice(s, s + args.micro_batch)
                lp = completion_logps(engine, ids[sl], attn[sl], cmask[sl])
                m = cmask[sl, 1:]
                ratio = torch.exp(lp - lp.detach())
                per_tok = -torch.min(ratio * adv[sl, None],
                                     ratio.clamp(1 - args.clip_eps, 1 + args.clip_eps) * adv[sl, None])
                if ref_engine is not None:
                    with torch.no_grad():
                        ref_lp = completion_logps(ref_engine, ids[sl], attn[sl], cmask[sl])
                    per_tok = per_tok + args.beta * (torch.exp(ref_lp - lp) - (ref_lp - lp) - 1)
                loss = (per_tok * m).sum() / m.sum().clamp(min=1)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            step += 1

            # ---- push the new weights to the vLLM server ----
            if rank == 0:
                for name, param in engine.module.named_parameters():
                    client.update_named_param(name, param.data)
                client.reset_prefix_cache()
            dist.barrier()

            stats = torch.stack([torch.stack(losses).mean(), rewards.mean(), cmask.sum(1).mean()])
            dist.all_reduce(stats, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {stats[0]:.4f} reward {stats[1]:.3f} "
                      f"len {stats[2]:.0f} {time.time() - t0:.1f}s", flush=True)

            if step % args.save_every == 0:
                engine.save_16bit_model(os.path.join(args.output_dir, f"step_{step}"))
                if rank == 0:
                    tok.save_pretrained(os.path.join(args.output_dir, f"step_{step}"))
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        client.close_communicator()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
