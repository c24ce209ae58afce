"""
OpenVLA-style fine-tuning: a VLM predicts 7-DoF actions as 256-bin tokens that overwrite the least
used vocabulary entries. Full fine-tuning with DeepSpeed ZeRO-3 + an fp32 EMA of the weights.

    deepspeed --num_nodes 2 --num_gpus 8 --hostfile hostfile train_vla_tokens.py \
        --train_shards "/data/oxe_magic_soup/train-{000000..002047}.tar" --val_shard /data/oxe_magic_soup/val-000000.tar
"""
import argparse
import io
import json
import os
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForVision2Seq, AutoProcessor
from transformers.integrations import HfDeepSpeedConfig

import wandb

N_BINS = 256


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--vlm", default="Qwen/Qwen2.5-VL-3B-Instruct")
    p.add_argument("--train_shards", required=True)
    p.add_argument("--val_shard", required=True)
    p.add_argument("--out", default="ckpt/vla_tokens")
    p.add_argument("--micro_bs", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--ema_every", type=int, default=10)
    p.add_argument("--ema_decay", type=float, default=0.999)
    p.add_argument("--eval_every", type=int, default=2500)
    p.add_argument("--save_every", type=int, default=5000)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class ActionTokenizer:
    def __init__(self, vocab_size):
        self.base = vocab_size - N_BINS  # last 256 ids
        self.edges = np.linspace(-1, 1, N_BINS + 1)

    def encode(self, a):
        b = np.clip(np.digitize(np.clip(a, -1, 1), self.edges) - 1, 0, N_BINS - 1)
        return (self.base + b).tolist()


def make_collate(processor, act_tok):
    def collate(samples):
        texts, images, targets = [], [], []
        for img, instr, action in samples:
            prompt = f"In: What action should the robot take to {instr.strip().lower()}?\nOut:"
            texts.append(processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
                add_generation_prompt=True))
            images.append(img)
            targets.append(act_tok.encode(action))
        enc = processor(text=texts, images=images, return_tensors="pt", padding=True)
        act_ids = torch.tensor(targets)
        input_ids = torch.cat([enc["input_ids"], act_ids], 1)
        attn = torch.cat([enc["attention_mask"], torch.ones_like(act_ids)], 1)
        labels = torch.full_like(input_ids, -100)
        labels[:, -act_ids.shape[1]:] = act_ids
        out = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        out.update(input_ids=input_ids, attention_mask=attn, labels=labels)
        return out
    return collate


def decode_sample(s):
    img = Image.open(io.BytesIO(s["jpg"])).convert("RGB").resize((224, 224))
    return img, s["txt"].decode(), np.load(io.BytesIO(s["npy"]))


def main():
    args = get_args()
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_bs * args.accum * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True,
                              "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                          "warmup_num_steps": 500, "total_num_steps": args.steps}},
    }
    # must exist before from_pretrained so the weights are loaded directly into ZeRO-3 partitions
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841
    processor = AutoProcessor.from_pretrained(args.vlm)
    model = AutoModelForVision2Seq.from_pretrained(args.vlm, torch_dtype=torch.bfloat16,
                                                   attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    act_tok = ActionTokenizer(model.config.vocab_size)
    collate = make_collate(processor, act_tok)

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    # fp32 EMA lives on rank 0's CPU; the partitioned weights are gathered for every update
    ema = None
    names = [n for n, _ in engine.module.named_parameters()]
    params = [p for _, p in engine.module.named_parameters()]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if rank == 0:
            ema = {n: p.detach().float().cpu().clone() for n, p in zip(names, params)}

    train = (wds.WebDataset(args.train_shards, resampled=True, shardshuffle=True, nodesplitter=None)
             .shuffle(5000).map(decode_sample))
    train_dl = wds.WebLoader(train, batch_size=args.micro_bs, collate_fn=collate, num_workers=8,
                             pin_memory=True).with_epoch(args.steps * args.accum)
    val_samples = [decode_sample(s) for s in wds.WebDataset(args.val_shard, shardshuffle=False)]
    val_sampler = DistributedSampler(val_samples, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_samples, batch_size=args.micro_bs, sampler=val_sampler, collate_fn=collate)

    step = 0
    if os.path.exists(os.path.join(args.out, "latest")):
        _, client = engine.load_checkpoint(args.out)
        step = client["step"]
        if rank == 0 and os.path.exists(os.path.join(args.out, "ema.pt")):
            ema = torch.load(os.path.join(args.out, "ema.pt"), map_location="cpu")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="vla-tokens", config=vars(args), resume="allow")

    engine.train()
    t0 = time.time()
    for batch in train_dl:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if not engine.is_gradient_accumulation_boundary():
            continue
        step += 1

        if step % args.ema_every == 0:
            d = args.ema_decay ** args.ema_every
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if rank == 0:
                    for n, p in zip(names, params):
                        ema[n].mul_(d).add_(p.detach().float().cpu(), alpha=1 - d)

        if step % 20 == 0:
            l = loss.detach().float()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                wandb.log({"train/loss": l.item(), "lr": engine.get_lr()[0],
                           "sec_per_step": (time.time() - t0) / 20}, step=step)
            t0 = time.time()

        if step % args.eval_every == 0:
            engine.eval()
            tot = torch.zeros(3, device=engine.device)
            with torch.no_grad():
                for vb in val_dl:  # same number of batches on each rank (drop_last)
                    vb = {k: v.to(engine.device) for k, v in vb.items()}
                    out = engine(**vb)
                    pred = out.logits[:, -8:-1].argmax(-1)  # logits at t predict token t+1
                    gt = vb["labels"][:, -7:]
                    tot += torch.stack([out.loss.float() * gt.numel(), (pred == gt).sum().float(),
                                        torch.tensor(float(gt.numel()), device=engine.device)])
            dist.all_reduce(tot)
            if rank == 0:
                wandb.log({"val/loss": (tot[0] / tot[2]).item(), "val/action_token_acc": (tot[1] / tot[2]).item()},
                          step=step)
            engine.train()

        if step % args.save_every == 0 or step == args.steps:
            engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step})
            engine.save_16bit_model(os.path.join(args.out, f"hf_step{step}"), "model.safetensors")
            if rank == 0:
                torch.save(ema, os.path.join(args.out, "ema.pt"))
                with open(os.path.join(args.out, f"hf_step{step}", "action_tokenizer.json"), "w") as f:
                    json.dump({"n_bins": N_BINS, "base": act_tok.base}, f)
            dist.barrier()
        if step >= args.steps:
            break

    if rank == 0:
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
