"""
LoRA fine-tuning of a Llama-style decoder with FSDP (full-shard, bf16) on an
instruction dataset stored as jsonl. Only the LoRA adapters are trainable; the
adapter weights are exported at the end of every epoch.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$HEAD:29500 lora_fsdp.py --model meta-llama/Llama-2-7b-hf \
        --data /shared/data/alpaca_cleaned.jsonl --out /shared/ckpt/llama7b_lora
"""
import argparse
import functools
import json
import math
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

PROMPT = ("Below is an instruction that describes a task. Write a response that "
          "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    return p.parse_args()


class InstructionDataset(Dataset):
    def __init__(self, path, tokenizer, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok = tokenizer
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        instr = r["instruction"] + (("\n\n" + r["input"]) if r.get("input") else "")
        prompt = PROMPT.format(instruction=instr)
        p_ids = self.tok(prompt, add_special_tokens=True)["input_ids"]
        a_ids = self.tok(r["output"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = (p_ids + a_ids)[: self.max_len]
        labels = ([-100] * len(p_ids) + a_ids)[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels)


def collate(batch, pad_id):
    n = max(len(x) for x, _ in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (x, y) in enumerate(batch):
        ids[i, : len(x)] = x
        labels[i, : len(y)] = y
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def save_adapter(model, args, epoch, rank):
    if rank == 0:
        save_policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_policy):
            full_sd = model.state_dict()
        adapter_sd = get_peft_model_state_dict(model.module, state_dict=full_sd)
        out_dir = os.path.join(args.out, f"epoch_{epoch}")
        os.makedirs(out_dir, exist_ok=True)
        torch.save(adapter_sd, os.path.join(out_dir, "adapter_model.bin"))
        model.module.peft_config["default"].save_pretrained(out_dir)
        print(f"saved adapter to {out_dir}", flush=True)
    dist.barrier()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(1234)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 low_cpu_mem_usage=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_cfg)
    if rank == 0:
        model.print_trainable_parameters()

    wrap_policy = functools.partial(transformer_auto_wrap_policy,
                                    transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )

    ds = InstructionDataset(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=1234)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        collate_fn=functools.partial(collate, pad_id=tok.pad_token_id),
                        drop_last=True)

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(loader) / args.grad_accum)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * steps_per_epoch * args.epochs),
                                            steps_per_epoch * args.epochs)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        loss_acc = torch.zeros(1, device="cuda")
        for i, batch in enumerate(loader):
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            out = model(**batch)
            loss = out.loss / args.grad_accum
            loss.backward()
            loss_acc += loss.detach()
            if (i + 1) % args.grad_accum == 0:
                model.clip_grad_norm_(1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if step % 10 == 0:
                    dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"epoch {epoch} step {step} loss {loss_acc.item() / 10:.4f} "
                              f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
                    loss_acc.zero_()
        save_adapter(model, args, epoch, rank)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
