"""LoRA fine-tuning of a Llama-style causal LM with FSDP (bf16), instruction data in jsonl.

    torchrun --nproc_per_node=8 03_lora_fsdp_causal_lm.py \
        --model meta-llama/Llama-3.2-1B --train-file data/sft_train.jsonl --eval-file data/sft_eval.jsonl
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--eval-file", required=True)
    ap.add_argument("--output-dir", default="out/lora_llama")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup-ratio", type=float, default=0.03)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument("--save-every", type=int, default=500, help="optimizer steps")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


class SFTDataset(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, idx):
        return self.rows[idx]


class SFTCollator:
    def __init__(self, tokenizer, max_len):
        self.tok = tokenizer
        self.max_len = max_len

    def __call__(self, rows):
        ids_list, labels_list = [], []
        for r in rows:
            prompt = self.tok(PROMPT.format(instruction=r["instruction"]), add_special_tokens=False)["input_ids"]
            answer = self.tok(r["output"] + self.tok.eos_token, add_special_tokens=False)["input_ids"]
            ids = ([self.tok.bos_token_id] + prompt + answer)[: self.max_len]
            labels = ([-100] * (1 + len(prompt)) + answer)[: self.max_len]
            ids_list.append(ids)
            labels_list.append(labels)
        width = max(len(x) for x in ids_list)
        pad = self.tok.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(zip(ids_list, labels_list)):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            attn[i, : len(ids)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attn}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        n = (batch["labels"][:, 1:] != -100).sum()
        tot += torch.stack([out.loss.float() * n, n.float()])
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def save_lora(model, tokenizer, out_dir, rank):
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            full_state = model.state_dict()
        lora_state = {k: v for k, v in full_state.items() if "lora_" in k}
        torch.save(lora_state, os.path.join(out_dir, "adapter_model.bin"))
        tokenizer.save_pretrained(out_dir)
        print(f"saved {len(lora_state)} LoRA tensors to {out_dir}")
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    accum = args.global_batch // (args.micro_batch * world)
    assert accum >= 1 and accum * args.micro_batch * world == args.global_batch, "bad batch config"

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    model = AutoModelForCausalLM.from_pretrained(
        args.model, torch_dtype=torch.float32, low_cpu_mem_usage=True, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    lora_cfg = LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora_cfg)
    if rank == 0:
        model.print_trainable_parameters()

    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )

    train_ds, eval_ds = SFTDataset(args.train_file), SFTDataset(args.eval_file)
    collate = SFTCollator(tokenizer, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    eval_sampler = DistributedSampler(eval_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.micro_batch, sampler=eval_sampler,
                         collate_fn=collate, num_workers=2)

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = len(train_dl) // accum
    total_steps = steps_per_epoch * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * total_steps), total_steps)

    step = 0
    model.train()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss / accum
            loss.backward()
            if (i + 1) % accum != 0:
                continue
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step}/{total_steps} loss {loss.item() * accum:.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.2f}s/it")
            if step % args.save_every == 0:
                save_lora(model, tokenizer, os.path.join(args.output_dir, f"step_{step}"), rank)

        eval_loss = evaluate(model, eval_dl, device)
        if rank == 0:
            print(f"epoch {epoch} eval loss {eval_loss:.4f} ppl {math.exp(eval_loss):.2f}")

    save_lora(model, tokenizer, os.path.join(args.output_dir, "final"), rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
