"""
DPO for an 8B model with DeepSpeed ZeRO-3 (policy trained, reference model
run as a second ZeRO-3 engine without optimizer). Weights are partitioned at
load time through HfDeepSpeedConfig, so no rank ever holds the full model.

    deepspeed --num_gpus 8 12_dpo_zero3_deepspeed.py \
        --model meta-llama/Llama-3.1-8B-Instruct --out ckpt/dpo_l8b \
        --micro_batch 1 --grad_accum 16
"""
import argparse
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    ap.add_argument("--dataset", default="mlabonne/orpo-dpo-mix-40k")
    ap.add_argument("--out", default="ckpt/dpo")
    ap.add_argument("--micro_batch", type=int, default=1)
    ap.add_argument("--grad_accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval_every", type=int, default=200)
    ap.add_argument("--local_rank", type=int, default=-1, help="filled in by the deepspeed launcher")
    return ap.parse_args()


def ds_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": 1, "warmup_num_steps": 1, "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def encode(tok, ex, max_len):
    prompt = tok.apply_chat_template(ex["chosen"][:-1], tokenize=False, add_generation_prompt=True)
    p = tok(prompt, add_special_tokens=False).input_ids
    out = {}
    for side in ("chosen", "rejected"):
        r = tok(ex[side][-1]["content"] + tok.eos_token, add_special_tokens=False).input_ids
        ids = (p + r)[:max_len]
        out[side] = ids
        out[side + "_start"] = min(len(p), len(ids))
    return out


def collate(rows, pad_id):
    seqs = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    starts = [r["chosen_start"] for r in rows] + [r["rejected_start"] for r in rows]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id)
    loss_mask = torch.zeros((len(seqs), L))
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        loss_mask[i, st:len(s)] = 1
    return ids, attn, loss_mask


def logp_sum(engine, ids, attn, mask):
    logits = engine(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    lp = torch.gather(logits.log_softmax(-1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (lp * mask[:, 1:]).sum(-1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or "<|finetune_right_pad_id|>"

    raw = load_dataset(args.dataset, split="train").train_test_split(test_size=512, seed=0)
    train_ds = raw["train"].map(lambda ex: encode(tok, ex, args.max_len), remove_columns=raw["train"].column_names)
    eval_ds = raw["test"].map(lambda ex: encode(tok, ex, args.max_len), remove_columns=raw["test"].column_names)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                          collate_fn=lambda b: collate(b, tok.pad_token_id), num_workers=2)
    eval_dl = DataLoader(eval_ds, batch_size=args.micro_batch,
                         sampler=DistributedSampler(eval_ds, shuffle=False, drop_last=True),
                         collate_fn=lambda b: collate(b, tok.pad_token_id))

    cfg = ds_config(args, world)
    total_updates = len(train_dl) * args.epochs // args.grad_accum
    cfg["scheduler"]["params"].update(total_num_steps=total_updates, warmup_num_steps=max(1, total_updates // 10))
    ref_cfg = {k: v for k, v in cfg.items() if k not in ("optimizer", "scheduler")}

    # must stay referenced while the models are created so from_pretrained uses zero.Init
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841
    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)

    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=cfg)
    ref_engine, *_ = deepspeed.initialize(model=ref, config=ref_cfg)
    ref_engine.eval()

    def dpo(batch):
        ids, attn, mask = (t.to(dev) for t in batch)
        n = ids.shape[0] // 2
        pol = logp_sum(engine, ids, attn, mask)
        with torch.no_grad():
            rl = logp_sum(ref_engine, ids, attn, mask)
        z = args.beta * ((pol[:n] - pol[n:]) - (rl[:n] - rl[n:]))
        return -F.logsigmoid(z).mean(), (z > 0).float().mean(), z.detach().mean() / args.beta

    def evaluate():
        engine.eval()
        acc = torch.zeros(3, device=dev)
        with torch.no_grad():
            for batch in eval_dl:
                loss, a, _ = dpo(batch)
                acc += torch.stack([loss, a, torch.ones((), device=dev)])
        dist.all_reduce(acc)
        engine.train()
        return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()

    def sample(prompt):
        # ZeRO-3: every rank has to take part in generate() so the layer gathers line up
        engine.eval()
        enc = tok(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                          add_generation_prompt=True), return_tensors="pt",
                  add_special_tokens=False).to(dev)
        with torch.no_grad():
            out = engine.module.generate(**enc, max_new_tokens=128, do_sample=False, synced_gpus=True,
                                         pad_token_id=tok.pad_token_id, use_cache=True)
        engine.train()
        return tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)

    micro, t0 = 0, time.time()
    engine.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for batch in train_dl:
            loss, acc, margin = dpo(batch)
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.grad_accum != 0:
                continue
            upd = engine.global_steps
            if upd % 10 == 0:
                m = torch.stack([loss.detach(), acc, margin])
                dist.all_reduce(m, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"update {upd}/{total_updates} loss {m[0]:.4f} acc {m[1]:.3f} margin {m[2]:.2f} "
                          f"lr {engine.get_lr()[0]:.2e} {(time.time() - t0) / 10:.1f}s/upd", flush=True)
                    t0 = time.time()
            if upd % args.eval_every == 0:
                el, ea = evaluate()
                text = sample("Explain why the sky is blue in two sentences.")
                if rank == 0:
                    print(f"[eval] update {upd} loss {el:.4f} reward_acc {ea:.3f}\n  sample: {text}", flush=True)
                engine.save_checkpoint(args.out, tag=f"update_{upd}", client_state={"epoch": epoch})

    engine.save_16bit_model(os.path.join(args.out, "hf"), "model.safetensors")
    if rank == 0:
        engine.module.config.save_pretrained(os.path.join(args.out, "hf"))
        tok.save_pretrained(os.path.join(args.out, "hf"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
