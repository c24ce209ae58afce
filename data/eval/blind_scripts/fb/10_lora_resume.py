"""LoRA fine-tuning of a 13B code model with DeepSpeed ZeRO-2; adapters saved separately so runs can be
warm-started from an earlier adapter.

deepspeed --num_gpus 8 lora_resume.py --base /models/CodeLlama-13b-hf --data data/code_instruct.jsonl \
    --out runs/cl13-lora --resume_adapter runs/cl13-lora-v1/adapter_step6000.pt
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume_adapter", default=None)
    ap.add_argument("--lora_r", type=int, default=64)
    ap.add_argument("--lora_alpha", type=int, default=128)
    ap.add_argument("--lora_dropout", type=float, default=0.05)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--save_every", type=int, default=500)
    ap.add_argument("--local_rank", type=int, default=-1)
    return ap.parse_args()


class CodeInstruct(Dataset):
    def __init__(self, path, tok, max_len):
        self.tok, self.max_len = tok, max_len
        with open(path) as f:
            self.data = [json.loads(x) for x in f]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        ex = self.data[i]
        src = f"### Task\n{ex['instruction']}\n\n### Solution\n"
        s = self.tok(src)["input_ids"]
        t = self.tok(ex["code"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (s + t)[: self.max_len]
        lab = ([-100] * len(s) + t)[: self.max_len]
        return ids, lab


def collate(pad_id):
    def fn(batch):
        L = max(len(a) for a, _ in batch)
        ids = torch.tensor([a + [pad_id] * (L - len(a)) for a, _ in batch])
        lab = torch.tensor([b + [-100] * (L - len(b)) for _, b in batch])
        att = torch.tensor([[1] * len(a) + [0] * (L - len(a)) for a, _ in batch])
        return ids, lab, att
    return fn


def main():
    args = parse()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    world = dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.base)
    tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.base, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                          task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_cfg)

    start_step = 0
    if args.resume_adapter:
        adapter_state = torch.load(args.resume_adapter)
        set_peft_model_state_dict(model, adapter_state["lora"])
        start_step = adapter_state.get("step", 0)
        if rank == 0:
            print(f"warm start from {args.resume_adapter} (step {start_step})", flush=True)

    if rank == 0:
        model.print_trainable_parameters()

    ds_config = {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": args.gas,
        "train_batch_size": args.mbs * args.gas * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": 100}},
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)

    ds = CodeInstruct(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=start_step)
    loader = DataLoader(ds, batch_size=args.mbs, sampler=sampler, collate_fn=collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True)

    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, lab, att in loader:
            loss = engine(input_ids=ids.to(engine.device), labels=lab.to(engine.device),
                          attention_mask=att.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = start_step + engine.global_steps
            if rank == 0 and step % 10 == 0:
                print(f"[{time.time() - t0:7.0f}s] epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if step % args.save_every == 0 and rank == 0:
                lora_sd = get_peft_model_state_dict(engine.module)
                torch.save({"lora": lora_sd, "step": step}, os.path.join(args.out, f"adapter_step{step}.pt"))

    if rank == 0:
        engine.module.save_pretrained(os.path.join(args.out, "adapter_final"))
        tok.save_pretrained(os.path.join(args.out, "adapter_final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
