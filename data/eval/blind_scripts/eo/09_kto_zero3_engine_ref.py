#!/usr/bin/env python
"""KTO for 8B models with DeepSpeed ZeRO-3; the reference model is a second (inference-only)
ZeRO-3 engine so that neither model is ever fully materialised on one GPU.

    deepspeed --num_gpus 8 09_kto_zero3_engine_ref.py --model ckpts/llama3.1-8b-sft \
        --data data/kto_feedback.jsonl --out runs/kto-8b
"""
import argparse
import copy
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

IGNORE = -100


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--w_desirable", type=float, default=1.0)
    ap.add_argument("--w_undesirable", type=float, default=1.33)
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--max_len", type=int, default=1536)
    ap.add_argument("--max_prompt_len", type=int, default=1024)
    ap.add_argument("--save_every", type=int, default=300)
    ap.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    return ap.parse_args()


def train_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_bs * args.accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.99], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                      "warmup_num_steps": args.warmup}},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10 ** 9,
    }


def ref_config(train_cfg):
    # same sharding, no optimizer / scheduler, parameters kept resident (nothing to offload)
    cfg = copy.deepcopy(train_cfg)
    for k in ("optimizer", "scheduler", "gradient_clipping"):
        cfg.pop(k, None)
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 1e4}
    return cfg


class Feedback(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                p = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                            add_generation_prompt=True)[-max_prompt_len:]
                c = tok(r["completion"] + "<|eot_id|>", add_special_tokens=False).input_ids[: max_len - len(p)]
                self.rows.append((p, c, bool(r["label"])))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class KTOCollate:
    """Target sequences first, then mismatched (prompt_i, completion_{i+1}) sequences for the KL term."""

    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        n = len(batch)
        rows = [(p, c) for p, c, _ in batch] + [(batch[i][0], batch[(i + 1) % n][1]) for i in range(n)]
        T = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(rows), T), dtype=torch.long)
        for k, (p, c) in enumerate(rows):
            ids[k, : len(p) + len(c)] = torch.tensor(p + c)
            lab[k, len(p): len(p) + len(c)] = torch.tensor(c)
            att[k, : len(p) + len(c)] = 1
        return ids, att, lab, torch.tensor([d for _, _, d in batch])


def sum_logps(engine, ids, att, lab):
    logits = engine(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    tgt = lab[:, 1:]
    m = tgt != IGNORE
    lp = logits.log_softmax(-1).gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * m).sum(-1)


def main():
    args = parse()
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    cfg = train_config(args, world)
    rcfg = ref_config(cfg)
    dschf = HfDeepSpeedConfig(cfg)  # noqa: F841 - must stay referenced so from_pretrained uses zero.Init

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = "<|finetune_right_pad_id|>"
    data = Feedback(args.data, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.micro_bs, sampler=sampler, collate_fn=KTOCollate(tok.pad_token_id),
                        num_workers=2, pin_memory=True, drop_last=True)

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=policy.parameters(), config=cfg)

    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    ref.requires_grad_(False)
    ref_engine, *_ = deepspeed.initialize(model=ref, config=rcfg)
    ref_engine.eval()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"examples={len(data)} micro_batches/rank={len(loader)} global_batch={cfg['train_batch_size']}",
              flush=True)

    micro, t0 = 0, time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, att, lab, desirable in loader:
            ids, att, lab, desirable = ids.to(device), att.to(device), lab.to(device), desirable.to(device)
            n = desirable.numel()
            pol = sum_logps(engine, ids, att, lab)
            with torch.no_grad():
                ref_lp = sum_logps(ref_engine, ids, att, lab)

            kl = (pol[n:] - ref_lp[n:]).mean().detach()
            dist.all_reduce(kl, op=dist.ReduceOp.AVG)
            kl = kl.clamp(min=0)
            logratio = pol[:n] - ref_lp[:n]
            loss_d = 1 - torch.sigmoid(args.beta * (logratio[desirable] - kl))
            loss_u = 1 - torch.sigmoid(args.beta * (kl - logratio[~desirable]))
            loss = torch.cat([args.w_desirable * loss_d, args.w_undesirable * loss_u]).mean()

            engine.backward(loss)
            engine.step()
            micro += 1

            if micro % args.accum == 0:
                step = engine.global_steps
                rew = args.beta * logratio.detach()
                s = torch.stack([loss.detach().float(), rew[desirable].sum(), desirable.sum().float(),
                                 rew[~desirable].sum(), (~desirable).sum().float()])
                dist.all_reduce(s)
                if rank == 0 and step % 10 == 0:
                    print(json.dumps({"step": step, "loss": s[0].item() / world, "kl": kl.item(),
                                      "reward_desirable": (s[1] / s[2].clamp(min=1)).item(),
                                      "reward_undesirable": (s[3] / s[4].clamp(min=1)).item(),
                                      "lr": engine.get_lr()[0], "sec": int(time.time() - t0)}), flush=True)
                if step % args.save_every == 0:
                    # collective: every rank writes its own ZeRO shard into the same tag directory
                    engine.save_checkpoint(args.out, tag=f"step{step}")
                    with deepspeed.zero.GatheredParameters(engine.module.get_input_embeddings().weight):
                        emb_norm = engine.module.get_input_embeddings().weight.float().norm().item()
                    if rank == 0:
                        print(f"saved step{step}; embedding norm {emb_norm:.2f}", flush=True)

    engine.save_16bit_model(os.path.join(args.out, "final"))
    if rank == 0:
        tok.save_pretrained(os.path.join(args.out, "final"))
        engine.module.config.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
