"""Math reasoning SFT (chain-of-thought traces) on a 13B model with ZeRO-3.

torchrun --nproc_per_node 8 math_sft_zero3.py --model /weights/llama-2-13b \
    --traces /data/math/cot_traces.jsonl --out /ckpt/math13b --epochs 3
"""
import argparse
import json
import logging
import os

import deepspeed
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

log = logging.getLogger("math_sft")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max_len", type=int, default=1536)
    ap.add_argument("--save_every", type=int, default=400)
    return ap.parse_args()


class CoTDataset(Dataset):
    def __init__(self, path, tok, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        q = f"Question: {r['question']}\nLet's think step by step.\n"
        a = f"{r['rationale']}\nThe answer is: {r['answer']}{self.tok.eos_token}"
        q_ids = self.tok(q)["input_ids"]
        a_ids = self.tok(a, add_special_tokens=False)["input_ids"]
        ids = (q_ids + a_ids)[: self.max_len]
        labels = ([-100] * len(q_ids) + a_ids)[: self.max_len]
        return ids, labels


def collate(pad):
    def f(b):
        L = max(len(x) for x, _ in b)
        return (torch.tensor([x + [pad] * (L - len(x)) for x, _ in b]),
                torch.tensor([y + [-100] * (L - len(y)) for _, y in b]),
                torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x, _ in b]))
    return f


def build_config(args, world):
    return {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": args.gas,
        "train_batch_size": args.mbs * args.gas * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 100}},
        "steps_per_print": 100,
    }


def export_fp32_state(engine, path):
    """Write a consolidated, un-sharded state dict for the eval harness (gathers one tensor at a time)."""
    state = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            state[name] = param.data.float().cpu().clone()
    torch.save(state, path)
    return len(state)


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    ds_config = build_config(args, world)
    hfcfg = HfDeepSpeedConfig(ds_config)  # noqa: F841

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.pad_token or tok.unk_token
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    ds = CoTDataset(args.traces, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=args.mbs, sampler=sampler, collate_fn=collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True)
    log.info("%d traces, %d micro-batches per rank per epoch", len(ds), len(loader))

    start_epoch = 0
    if os.path.exists(os.path.join(args.out, "latest")):
        _, client = engine.load_checkpoint(args.out)
        start_epoch = client.get("epoch", -1) + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, labels, att in loader:
            out = engine(input_ids=ids.to(engine.device), attention_mask=att.to(engine.device),
                         labels=labels.to(engine.device))
            engine.backward(out.loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if step % 10 == 0:
                log.info("epoch %d step %d loss %.4f lr %.2e", epoch, step, out.loss.item(), engine.get_lr()[0])
            if step % args.save_every == 0:
                engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"epoch": epoch - 1})
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch})

    if rank == 0:
        os.makedirs(os.path.join(args.out, "consolidated"), exist_ok=True)
        n = export_fp32_state(engine, os.path.join(args.out, "consolidated", "model_fp32.pt"))
        tok.save_pretrained(os.path.join(args.out, "consolidated"))
        engine.module.config.save_pretrained(os.path.join(args.out, "consolidated"))
        log.info("exported %d tensors", n)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
