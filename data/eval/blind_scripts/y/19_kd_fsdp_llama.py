"""Distill Llama-3.1-8B-Instruct into Llama-3.2-1B with FSDP.

Both models are FSDP-sharded (the teacher only runs forward, in bf16).
Loss = (1 - a) * CE(student) + a * forward KL(teacher || student) on answer tokens.

torchrun --nproc_per_node=8 kd_fsdp.py --teacher meta-llama/Llama-3.1-8B-Instruct \
    --student meta-llama/Llama-3.2-1B --data data/sft_mix.jsonl --out ckpt/llama1b-kd
"""
import argparse
import functools
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class SFTJsonl(Dataset):
    """Rows: {"messages": [...]} ; only assistant tokens get labels."""

    def __init__(self, path, tok, max_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.max_len = tok, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        msgs = self.rows[i]["messages"]
        prompt = self.tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True)
        full = self.tok.apply_chat_template(msgs, tokenize=True)
        full = full[: self.max_len]
        labels = [-100] * min(len(prompt), len(full)) + full[len(prompt):]
        pad = self.max_len - len(full)
        return (torch.tensor(full + [self.tok.pad_token_id] * pad),
                torch.tensor([1] * len(full) + [0] * pad),
                torch.tensor(labels + [-100] * pad))


def kd_loss(s_logits, t_logits, labels, alpha, temp):
    s = s_logits[:, :-1].float()
    t = t_logits[:, :-1].float()
    y = labels[:, 1:]
    mask = (y != -100)
    ce = F.cross_entropy(s.reshape(-1, s.size(-1)), y.reshape(-1), ignore_index=-100)
    t_prob = F.softmax(t / temp, -1)
    kl = (t_prob * (F.log_softmax(t / temp, -1) - F.log_softmax(s / temp, -1))).sum(-1)
    kl = (kl * mask).sum() / mask.sum().clamp(min=1) * temp ** 2
    return (1 - alpha) * ce + alpha * kl, ce.detach(), kl.detach()


def fsdp_wrap(model, device, train):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if train else torch.bfloat16,
                        buffer_dtype=torch.bfloat16)
    return FSDP(model, auto_wrap_policy=policy, mixed_precision=mp, device_id=device,
                sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True, limit_all_gathers=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--val_data", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--save_every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.student)
    if tok.pad_token is None:
        tok.pad_token = "<|finetune_right_pad_id|>"

    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.bfloat16)
    teacher.requires_grad_(False)
    teacher = fsdp_wrap(teacher, device, train=False).eval()

    student = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student = fsdp_wrap(student, device, train=True)

    ds = SFTJsonl(args.data, tok, args.max_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = None
    if args.val_data:
        vds = SFTJsonl(args.val_data, tok, args.max_len)
        val_loader = DataLoader(vds, batch_size=args.micro_bs,
                                sampler=DistributedSampler(vds, shuffle=False, drop_last=True))

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = args.epochs * len(loader)
    sched = get_cosine_schedule_with_warmup(opt, int(0.03 * total), total)

    def save(tag):
        if rank == 0:
            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(student, StateDictType.FULL_STATE_DICT, cfg):
                state = student.state_dict()
            path = os.path.join(args.out, tag)
            os.makedirs(path, exist_ok=True)
            torch.save(state, os.path.join(path, "pytorch_model.bin"))
            student.module.config.save_pretrained(path)
            tok.save_pretrained(path)
        dist.barrier()

    @torch.no_grad()
    def evaluate():
        student.eval()
        tot = torch.zeros(2, device=device)
        for ids, mask, labels in val_loader:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            out = student(input_ids=ids, attention_mask=mask, labels=labels)
            tot += torch.stack([out.loss.float(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        student.train()
        return (tot[0] / tot[1]).item()

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        for ids, mask, labels in loader:
            ids, mask, labels = (t.to(device, non_blocking=True) for t in (ids, mask, labels))
            with torch.no_grad():
                t_logits = teacher(input_ids=ids, attention_mask=mask).logits
            s_logits = student(input_ids=ids, attention_mask=mask).logits
            loss, ce, kl = kd_loss(s_logits, t_logits, labels, args.alpha, args.temp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            student.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 10 == 0:
                logs = torch.stack([loss.detach(), ce, kl])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {logs[0]:.4f} ce {logs[1]:.4f} "
                          f"kl {logs[2]:.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if step % args.save_every == 0:
                if val_loader is not None:
                    vl = evaluate()
                    if rank == 0:
                        print(f"[val] step {step} loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                save(f"step_{step}")

    save("final")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
