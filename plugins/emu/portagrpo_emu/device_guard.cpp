// The emulated device's C++ device guard, for N devices per process (portagrpo_emu/multi_device.py
// builds it when PORTAGRPO_EMU_DEVICES or the simulated Ascend asks for more than one).
//
// Why C++: PyTorch's Python device guard (torch/csrc/acc/Module.cpp, PythonDeviceGuard) answers
// deviceCount() == 1 and getDevice() == index 0. The autograd engine sizes its per-device ready queues
// from the largest deviceCount() of the registered guards, so a backward pass on index 1 fails its
// internal assert. This guard reports the emulated device count and keeps a current index per thread
// (as CUDA's current device is per thread); it is registered for PrivateUse1 when the library is
// loaded, before torch.utils.backend_registration registers the Python one (which then steps aside).
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>

namespace {

std::atomic<int> g_device_count{1};
thread_local c10::DeviceIndex t_current = 0;

struct EmulatedDeviceGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::PrivateUse1; }

  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    t_current = device.index();
    return previous;
  }
  c10::Device getDevice() const override { return c10::Device(type(), t_current); }
  void setDevice(c10::Device device) const override { t_current = device.index(); }
  void uncheckedSetDevice(c10::Device device) const noexcept override { t_current = device.index(); }

  // Every emulated kernel has finished when its call returns: one default stream, events always complete.
  c10::Stream getStream(c10::Device device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream exchangeStream(c10::Stream stream) const noexcept override { return stream; }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_device_count.load());
  }
  void record(void** /*event*/, const c10::Stream& /*stream*/, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag /*flag*/) const override {}
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void destroyEvent(void* /*event*/, const c10::DeviceIndex /*device_index*/) const noexcept override {}
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
};

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, EmulatedDeviceGuard);

extern "C" {
void portagrpo_emu_set_device_count(int count) { g_device_count.store(count); }
void portagrpo_emu_set_current_device(int index) { t_current = static_cast<c10::DeviceIndex>(index); }
int portagrpo_emu_current_device() { return static_cast<int>(t_current); }
}
