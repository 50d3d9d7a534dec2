// Submit now, wait later: engine calls run one after another on a single driver thread (which
// drives the pool), so Python can release the GIL and let the GPU work meanwhile. Calls are
// serialized, which is what lets every layer share one scratch workspace.
#pragma once
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace kt {

// Called in a forked child (its fork handler): tickets made before it belong to calls that run in the parent only.
void tickets_after_fork();

class Ticket {
 public:
  Ticket();
  // Blocks until the job has run; rethrows its exception, if any (once per ticket). In a forked child, a call
  // that had not finished before the fork throws instead of waiting forever.
  void wait();
  // True too for such a call: it will never finish here.
  bool done();

 private:
  friend class AsyncQueue;
  bool from_before_fork() const;
  const unsigned forks_;  // tickets_after_fork() calls before this ticket was made
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class AsyncQueue {
 public:
  AsyncQueue();
  ~AsyncQueue();
  std::shared_ptr<Ticket> submit(std::function<void()> job);
  // Runs `job` on the calling thread once every job submitted before it has finished, with the same
  // serialization as submitted jobs, and returns its ticket, already done (wait() rethrows its error): a call
  // that is waited for at once skips the two thread hand-offs (wake the driver, wake the caller) that
  // submit + wait costs.
  std::shared_ptr<Ticket> run_now(const std::function<void()>& job);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  bool busy_ = false;  // a job is running, on the driver or on a run_now caller
  std::deque<std::pair<std::function<void()>, std::shared_ptr<Ticket>>> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace kt
