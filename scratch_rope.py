import torch
from tests.ops.test_rope import qk, trig
from slimrl.ops.rope import rope_reference
from slimrl.ops.kernels.rope import rope as kernel
for dtype in (torch.float32, torch.bfloat16):
    q, k = (t.cuda() for t in qk(2, 1031, 12, 2, 128, dtype))
    cos, sin = (t.cuda() for t in trig(1, 1031, 128, dtype))
    leaves = [t.clone().requires_grad_() for t in (q, k, q, k)]
    expected, got = rope_reference(leaves[0], leaves[1], cos, sin), kernel(leaves[2], leaves[3], cos, sin)
    grads = [torch.randn_like(t) for t in expected]
    torch.autograd.backward(expected, grads)
    torch.autograd.backward(got, grads)
    for name, want, have in zip("q k dq dk".split(), (*expected, leaves[0].grad, leaves[1].grad), (*got, leaves[2].grad, leaves[3].grad)):
        bad = (have != want)
        print(dtype, name, bad.sum().item(), bad.numel(), (have.float()-want.float()).abs().max().item())
        if bad.any():
            idx = bad.nonzero()[0].tolist(); print('  at', idx, have[tuple(idx)].item(), want[tuple(idx)].item())
    # manual eager of one element
    x = q[0,5,3]; c = cos[0,5]; s = sin[0,5]
    h=64
    e1 = (x[:h]*c[:h]) + ((-x[h:])*s[:h])
    print('manual eq', torch.equal(e1, expected[0][0,5,3,:h].detach()))
